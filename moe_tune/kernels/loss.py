"""Chunked linear cross-entropy: the loss from the last hidden states and the output embedding without
ever materialising the full logits.

At vocab 151,936 and 4096 tokens the fp32 logits alone are 2.5 GB per sequence, and autograd would keep
them (plus their softmax) for backward. Here logits exist one chunk of rows at a time: the forward pass
computes each chunk's loss *and* its gradients (softmax minus one-hot, the only thing backward needs), so
backward just scales the stored gradients by the incoming scalar.
fp32 island: each chunk's logits, log-sum-exp and softmax are fp32; gradients are cast back to the inputs'
dtype, and the weight gradient is accumulated in fp32.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, ignore_index: int, chunk_size: int):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # A frozen output embedding (LoRA) needs no weight gradient: its GEMM and fp32 buffer are skipped.
        need_grad_w = ctx.needs_input_grad[1]
        N = h_ND.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if need_grad else None
        one_chunk = N <= chunk_size
        # Several chunks add their weight gradients in fp32; one chunk writes its GEMM's result directly.
        grad_w = (
            None if one_chunk or not need_grad_w else torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        )
        for start in range(0, N, chunk_size):
            h = h_ND[start : start + chunk_size]
            y = labels_N[start : start + chunk_size]
            valid = y != ignore_index
            safe_y = torch.where(valid, y, 0)
            logits = (h @ w_VD.t()).float()  # the chunk's only [rows, V] fp32 buffer: reused in place below
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_y.unsqueeze(1)).squeeze(1)
            loss += torch.where(valid, lse - picked, 0.0).sum()
            if need_grad:
                # d loss / d logits = softmax - onehot(label) on valid rows, 0 on ignored rows. Ignored rows are
                # zeroed in the [rows, D] operands, not the [rows, V] one: V / D times less memory traffic.
                g = logits.sub_(lse.unsqueeze(1)).exp_()
                g.scatter_add_(1, safe_y.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
                g_low = g.to(h.dtype)
                del g, logits
                keep = valid.unsqueeze(1).to(h.dtype)
                torch.mul(g_low @ w_VD, keep, out=grad_h[start : start + chunk_size])
                if not need_grad_w:
                    continue
                gw = g_low.t() @ (h * keep)
                if one_chunk:
                    grad_w = gw
                else:
                    grad_w += gw.float()
        if need_grad:
            if grad_w is None and need_grad_w:  # no rows at all
                grad_w = torch.zeros_like(w_VD)
            ctx.save_for_backward(grad_h, grad_w.to(w_VD.dtype) if need_grad_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return grad_h * grad_loss.to(grad_h.dtype), grad_w, None, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100, chunk_size: int = 4096
) -> torch.Tensor:
    """Sum over non-ignored rows of ``cross_entropy(h @ w.T, labels)``, as an fp32 scalar."""
    return _LinearCrossEntropy.apply(h_ND, w_VD, labels_N, ignore_index, chunk_size)
