"""Chunked linear cross-entropy equals plain cross-entropy on full fp32 logits, forward and backward."""

import pytest
import torch

from moe_tune.kernels.loss import linear_cross_entropy


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
