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
    path = tiny_checkpoint("qwen3_moe", router_aux_loss_coef=0.01)
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
