"""Chunked linear cross-entropy equals plain cross-entropy on full fp32 logits, forward and backward."""

import pytest
import torch

from moe_tune.kernels.loss import linear_cross_entropy
from tests.harness import triton_interpreted


def reference(h, w, labels):
    logits = (h @ w.t()).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_matches_cross_entropy_fp32(chunk_size):
    g = torch.Generator().manual_seed(0)
    N, D, V = 50, 16, 97
    h = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(V, D, generator=g).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:10] = -100  # a masked prompt
    labels[25] = -100  # an isolated ignored position
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    ours = linear_cross_entropy(h, w, labels, chunk_size=chunk_size)
    ref = reference(h2, w2, labels)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    (ours * 0.5).backward()
    (ref * 0.5).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    assert torch.all(h.grad[:10] == 0)  # masked positions get no gradient


def test_bf16_chunks_match_one_chunk_and_no_rows_is_zero():
    """bf16 inputs: several chunks (fp32 weight-gradient accumulation) and one chunk agree to bf16 rounding of
    the accumulation order; an empty batch gives a zero loss and zero gradients."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(53, 16, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 53, (40,), generator=g)
    grads = []
    for chunk in (40, 8):
        h.grad = w.grad = None
        linear_cross_entropy(h, w, labels, chunk_size=chunk).backward()
        grads.append((h.grad.clone(), w.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)  # row gradients do not depend on chunking
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=2e-2, atol=2e-2)
    empty_h = torch.zeros(0, 16, requires_grad=True)
    empty_w = torch.randn(53, 16, requires_grad=True)
    loss = linear_cross_entropy(empty_h, empty_w, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(empty_w.grad == 0)


def test_under_autocast_matches_bf16_inputs_and_grads_reach_fp32_leaves():
    """train.precision=amp_bf16: fp32 hidden states and weight under bf16 autocast give the loss and gradients of
    the same inputs cast to bf16, and the gradients land on the fp32 leaves."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(24, 16, generator=g).requires_grad_()
    w = torch.randn(37, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 37, (24,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, labels, chunk_size=8)
    ours.backward()
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = linear_cross_entropy(hb, wb, labels, chunk_size=8)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, hb.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, wb.grad.float(), rtol=0, atol=0)


def test_all_ignored_is_zero_with_zero_grads():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_no_grad_path_and_model_loss_equal():
    """Inside the model: fused and unfused losses agree (the model shifts labels itself)."""
    from moe_tune.models.init import init_random
    from moe_tune.models.model import ModelOptions, build_model, materialize
    from moe_tune.models.presets import preset_config

    config = preset_config("tiny_qwen3_moe", {"num_hidden_layers": 1}, vocab_size=64)
    losses = []
    for chunk in (None, 5):  # full logits + cross_entropy, then the chunked linear cross-entropy
        model = build_model(config, ModelOptions(loss_chunk_size=chunk))
        materialize(model, "cpu")
        init_random(model, seed=0, num_experts=model.num_experts)
        assert (model.loss_fn is None) == (chunk is None)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[:, :4] = -100
        model.eval()
        with torch.no_grad():
            losses.append(model(ids, labels=labels).loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)


def test_frozen_weight_gets_no_gradient_and_the_same_input_gradient():
    """LoRA freezes the output embedding: its weight-gradient GEMM is skipped, the hidden states' gradient is the
    same as with a trained weight."""
    from moe_tune.kernels.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g)
    w = torch.randn(32, 16, generator=g)
    labels = torch.randint(0, 32, (40,), generator=g)
    grads = []
    for trained in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(trained)
        linear_cross_entropy(hh, ww, labels, chunk_size=16).backward()
        assert (ww.grad is not None) == trained
        grads.append(hh.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_a_trained_weight_over_frozen_hidden_states_gets_the_cross_entropy_gradient(chunk_size):
    """Only the output embedding trains (hidden states that need no gradient): its gradient is plain
    cross-entropy's on fp32 logits, within fp32 rounding, in several chunks and in one."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(40, 16, generator=g)
    w = torch.randn(32, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 32, (40,), generator=g)
    labels[:5] = -100
    w_ref = w.detach().clone().requires_grad_()
    linear_cross_entropy(h, w, labels, chunk_size=chunk_size).backward()
    reference(h, w_ref, labels).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)


def _interpreted(check: str) -> None:
    """Runs ``check`` (a function of this module) under Triton's interpreter with a small column block, so that
    each row takes several steps of both passes."""
    code = f"import moe_tune.kernels.loss as l; l.BLOCK = 32; import {__name__} as t; t.{check}()"
    triton_interpreted(code, "test_cuda_kernel_matches_pytorch_ops_and_fp32_reference")


def _kernel_matches_pytorch_ops():
    from moe_tune.kernels.loss import softmax_grad_

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(9, 97, generator=g) * 4).to(dtype)
        labels = torch.randint(0, 97, (9,), generator=g)
        labels[[0, 5]] = -100
        labels[1] = 96  # the last column, in the partial block
        ours, ref = logits.clone(), logits.clone()
        loss_ours = softmax_grad_(ours, labels, -100, triton=True)
        loss_ref = softmax_grad_(ref, labels, -100, triton=False)
        torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-6, atol=1e-6)
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
        assert torch.all(ours[[0, 5]] == 0) and loss_ours[[0, 5]].eq(0).all()
        assert ours[1, 96] < 0  # softmax - 1 at the label


def test_triton_kernel_matches_pytorch_ops():
    """The Triton kernel against PyTorch's ops: per-row losses and the in-place gradient over 97 columns (3 full
    blocks of 32 and a partial one; a label in the last column), ignored rows 0. fp32: within 1e-6; bf16 logits:
    the gradient within one bf16 rounding (both round the same fp32 value, computed in another order)."""
    _interpreted("_kernel_matches_pytorch_ops")


def _loss_with_kernel_matches_cross_entropy():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(21, 16, generator=g).requires_grad_()
    w = torch.randn(70, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 70, (21,), generator=g)
    labels[:3] = -100
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ours = linear_cross_entropy(h, w, labels, chunk_size=8, triton=True)
    ref = reference(h2, w2, labels)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_triton_loss_matches_cross_entropy():
    """The whole chunked loss with the kernel, forward and backward, against cross_entropy on full fp32 logits
    (three chunks, fp32 accumulation of the weight gradient)."""
    _interpreted("_loss_with_kernel_matches_cross_entropy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel's compiled form needs a CUDA GPU")
def test_cuda_kernel_matches_pytorch_ops_and_fp32_reference():
    """bf16 on a GPU, three chunks (the last partial), vocab not a multiple of the kernel's block, ignored rows:
    the Triton kernel (with the weight gradient accumulated by fp32-output GEMMs) against PyTorch's ops on the
    same bf16 logits (loss within 1e-5, gradients within 1% in norm: each rounds the same fp32 softmax to bf16,
    computed in another order) and against cross_entropy on fp32 logits from the same bf16 inputs (within 2%:
    the logits themselves are rounded to bf16 in both paths)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, D, V = 2500, 256, 50_001
    h = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) / 8).bfloat16()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels[::7] = -100

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward()
        return loss.detach().float(), hh.grad.float(), ww.grad.float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    kernel = run(lambda a, b: linear_cross_entropy(a, b, labels, chunk_size=1024, triton=True))
    ops = run(lambda a, b: linear_cross_entropy(a, b, labels, chunk_size=1024, triton=False))
    fp32 = run(lambda a, b: reference(a.float(), b.float(), labels))
    assert rel(kernel[0], ops[0]) < 1e-5
    assert rel(kernel[1], ops[1]) < 1e-2 and rel(kernel[2], ops[2]) < 1e-2
    assert all(rel(a, b) < 2e-2 for a, b in zip(kernel, fp32)), [rel(a, b) for a, b in zip(kernel, fp32)]
    assert torch.all(kernel[1][::7] == 0)
