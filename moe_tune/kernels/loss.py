"""Chunked linear cross-entropy: the loss from the last hidden states and the output embedding without
ever materialising the full logits.

At vocab 151,936 and 4096 tokens the fp32 logits alone are 2.5 GB per sequence, and autograd would keep
them (plus their softmax) for backward. Here logits exist one chunk of rows at a time, in the inputs' dtype: the
forward pass computes each chunk's loss *and* its gradients (softmax minus one-hot, the only thing backward
needs), so backward just scales the stored gradients by the incoming scalar.

fp32 island: each row's log-sum-exp and softmax are computed in fp32 from the stored logits. On a GPU one Triton
kernel does it in place over the chunk's logits (``triton_loss.softmax_grad_kernel``: three passes over the bf16
chunk); PyTorch's ops, used on a CPU, make an fp32 copy and pass over it about seven times. The weight gradient
is accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch

BLOCK = 4096  # columns per step of the kernel's passes over a row; 8 warps of 16-byte loads


def softmax_grad_(logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int, triton: bool) -> torch.Tensor:
    """In place: ``logits_NV`` becomes d loss / d logits (``softmax - onehot(label)``, 0 on ignored rows), in its
    dtype. Returns each row's loss ``logsumexp - logit[label]`` in fp32 (0 on ignored rows). ``triton``: the
    kernel (also on CPU tensors under TRITON_INTERPRET=1) or PyTorch's ops."""
    N, V = logits_NV.shape
    if triton:
        from moe_tune.kernels.triton_loss import softmax_grad_kernel

        loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        if N:
            softmax_grad_kernel[(N,)](
                logits_NV, labels_N, loss_N, logits_NV.stride(0), V, ignore_index, BLOCK=BLOCK, num_warps=8
            )
        return loss_N
    valid_N = labels_N != ignore_index
    safe_N = torch.where(valid_N, labels_N, 0).unsqueeze(1)
    x = logits_NV.float()  # the same tensor when the logits are fp32
    lse_N = torch.logsumexp(x, dim=-1)
    loss_N = torch.where(valid_N, lse_N - x.gather(1, safe_N).squeeze(1), 0.0)
    g = x.sub_(lse_N.unsqueeze(1)).exp_()
    g.scatter_add_(1, safe_N, torch.full(safe_N.shape, -1.0, device=g.device)).mul_(valid_N.unsqueeze(1))
    if g is not logits_NV:
        logits_NV.copy_(g)
    return loss_N


def _add_transposed_product(acc_VD: torch.Tensor, g_NV: torch.Tensor, h_ND: torch.Tensor) -> torch.Tensor:
    """``acc += g^T @ h`` in the fp32 accumulator: on a GPU one GEMM that adds in fp32 and writes in place (no
    bf16 product to round, copy and add; no copy of the accumulator); on a CPU the product in the inputs' dtype,
    then added."""
    if g_NV.dtype == acc_VD.dtype:
        return acc_VD.addmm_(g_NV.t(), h_ND)
    if g_NV.is_cuda:
        return torch.addmm(acc_VD, g_NV.t(), h_ND, out_dtype=acc_VD.dtype, out=acc_VD)
    return acc_VD.add_(g_NV.t() @ h_ND)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, ignore_index: int, chunk_size: int, triton: bool):
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
            logits = h @ w_VD.t()  # the chunk's only [rows, V] buffer: becomes its gradient in place
            loss += softmax_grad_(logits, labels_N[start : start + chunk_size], ignore_index, triton).sum()
            if not need_grad:
                continue
            # Ignored rows' gradients are 0, so they add nothing to either product.
            torch.mm(logits, w_VD, out=grad_h[start : start + chunk_size])
            if need_grad_w:
                grad_w = logits.t() @ h if one_chunk else _add_transposed_product(grad_w, logits, h)
        if need_grad:
            if grad_w is None and need_grad_w:  # no rows at all
                grad_w = torch.zeros_like(w_VD)
            ctx.save_for_backward(grad_h, grad_w.to(w_VD.dtype) if need_grad_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return grad_h * grad_loss.to(grad_h.dtype), grad_w, None, None, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    triton: bool | None = None,
) -> torch.Tensor:
    """Sum over non-ignored rows of ``cross_entropy(h @ w.T, labels)``, as an fp32 scalar. ``triton``: None runs
    the Triton kernel on GPU tensors and PyTorch's ops on CPU ones."""
    if triton is None:
        triton = h_ND.is_cuda
    device = h_ND.device.type
    if torch.is_autocast_enabled(device):
        # Under autocast (train.precision=amp_bf16) the GEMMs run in its dtype, as an autocast lm_head's would; the
        # casts carry the gradients back to the fp32 parameters, and autocast is off inside, where each GEMM's
        # operands and output buffer must share one dtype.
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return _LinearCrossEntropy.apply(h_ND.to(dtype), w_VD.to(dtype), labels_N, ignore_index, chunk_size, triton)
    return _LinearCrossEntropy.apply(h_ND, w_VD, labels_N, ignore_index, chunk_size, triton)
