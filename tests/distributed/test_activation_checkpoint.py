"""Activation checkpointing keeps fewer activations, changes no number and keeps Hugging Face parameter names."""

from __future__ import annotations

import pytest
import torch

from moe_tune.build import from_pretrained
from moe_tune.config import ConfigError
from moe_tune.distributed.activation_checkpoint import apply_ac
from tests.tiny import VOCAB


def _run(path: str, mode: str) -> tuple[int, float, dict[str, torch.Tensor], list[str]]:
    model = from_pretrained(path)
    apply_ac(model, mode)
    model.train()
    saved = [0]

    def pack(t):
        saved[0] += t.numel()
        return t

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return saved[0], out.loss.item(), grads, [n for n, _ in model.named_parameters()]


def test_modes_save_less_and_match(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", router_aux_loss_coef=0.01, output_router_logits=True)  # aux loss on
    none, selective, full = (_run(path, mode) for mode in ("none", "selective", "full"))
    assert none[0] > selective[0] > full[0]  # elements kept for backward
    for _, loss, grads, names in (selective, full):
        assert names == none[3]  # no wrapper module: parameter names unchanged
        assert loss == none[1]
        for n, g in grads.items():
            torch.testing.assert_close(g, none[2][n], rtol=1e-6, atol=1e-7)


def test_unknown_mode_fails():
    with pytest.raises(ConfigError, match="parallel.activation_checkpointing='some'"):
        apply_ac(None, "some")


def _nf4_lora_run(path: str, mode: str, monkeypatch) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(dequantizations of the NF4 experts in one forward and backward, the loss, the adapters' gradients)."""
    from moe_tune.kernels import nf4_frozen
    from moe_tune.lora import LoRASpec
    from moe_tune.moe.experts import ExpertsOptions

    lora = LoRASpec(rank=8, alpha=16.0, targets=("experts",))
    model = from_pretrained(path, lora=lora, experts=ExpertsOptions(quantized_base="nf4"))
    with torch.no_grad():  # nonzero B: the adapters move the output, so the input gradient reaches every layer's A
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    apply_ac(model, mode)
    model.train()
    calls, dequantize = [0], nf4_frozen.dequantize_weight

    def counted(*args, **kwargs):
        calls[0] += 1
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(nf4_frozen, "dequantize_weight", counted)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    out.loss.backward()
    return calls[0], out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_recomputed_nf4_layer_keeps_its_dequantized_experts_for_the_input_gradient(tiny_checkpoint, monkeypatch):
    """Full checkpointing: each projection is dequantized in the forward and in the recompute, whose dequantized
    experts serve the input gradient (2 per projection and layer, where dequantizing again for it would be 3); the
    loss and every adapter's gradient are those of the run without checkpointing, bit for bit. Without
    checkpointing nothing dequantized is kept (forward and input gradient: 2, but 1 for the first layer's gate_up,
    whose input has no gradient: nothing before it trains)."""
    path = tiny_checkpoint("qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    projections = 2 * 2  # gate_up and down, 2 layers
    none, full = (_nf4_lora_run(path, mode, monkeypatch) for mode in ("none", "full"))
    assert none[0] == 2 * projections - 1
    assert full[0] == 2 * projections
    assert full[1] == none[1]
    assert full[2].keys() == none[2].keys() and any("experts" in n for n in none[2])
    for n, g in full[2].items():
        assert torch.equal(g, none[2][n]), n


def test_only_full_checkpointing_marks_nf4_projections_recomputed(tiny_checkpoint):
    """Selective checkpointing recomputes attention alone: the MoE half runs once, so its NF4 projections must not
    keep their dequantized experts for backward (every layer's would be held); full marks every one."""
    from moe_tune.lora import LoRASpec
    from moe_tune.moe.experts import ExpertsOptions
    from moe_tune.moe.quantized_base import FrozenNF4Projection

    path = tiny_checkpoint("qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    lora, experts = LoRASpec(rank=8, alpha=16.0, targets=("experts",)), ExpertsOptions(quantized_base="nf4")
    for mode in ("none", "selective", "full"):
        model = from_pretrained(path, lora=lora, experts=experts)
        apply_ac(model, mode)
        marks = [m.recomputed for m in model.modules() if isinstance(m, FrozenNF4Projection)]
        assert len(marks) == 2 * 2 and marks == [mode == "full"] * 4, mode
