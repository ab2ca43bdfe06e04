"""LoRA under expert parallelism on 2 gloo ranks, in the default precision (bf16_fp32_master): the base is frozen
in bf16 (routers kept in their dtype), adapters are fp32 and the only parameters with gradients and optimizer
state; after training steps the base is bitwise what was loaded and every kind of adapter has moved."""

from __future__ import annotations

import pytest
import torch

from tests.harness import FAST_TRAINER, run_ranks

OVERRIDES = [
    *[o for o in FAST_TRAINER if not o.startswith("train.precision")],
    "train.precision=bf16_fp32_master",
    "parallel.ep=2",
    "peft=lora",
    "peft.rank=8",
    "checkpoint.export_hf=false",
]


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _run(rank: int, out: str) -> None:
    from moe_tune.cli.train import compose, to_config
    from moe_tune.lora import is_adapter
    from moe_tune.train import Trainer

    t = Trainer(to_config(compose([f"output_dir={out}", *OVERRIDES])), write_run_files=False)
    named = dict(t.model.named_parameters())
    routers = {n for n in named if n.endswith("mlp.gate.weight")}
    adapters = {n for n in named if is_adapter(n)}
    assert adapters and {n for n, p in named.items() if p.requires_grad} == adapters
    for n, p in named.items():
        want = torch.float32 if n in adapters or n in routers else torch.bfloat16
        assert p.dtype == want, (n, p.dtype)
    before = {n: _full(p) for n, p in named.items()}
    for step in range(2):
        t.train_step(step)
    assert len(t.optimizer.state) == len(adapters)
    for n, p in named.items():
        after = _full(p)
        if n in adapters:
            assert n.endswith("A") or after.abs().max() > 0, n  # B left zero: it moved
        else:
            assert torch.equal(after, before[n]), n
    kinds = {n.rsplit(".", 1)[-1] for n in adapters}
    assert kinds == {"A", "B", "gate_up_A", "gate_up_B", "down_A", "down_B"}


@pytest.mark.dist
def test_lora_ep2_bf16_base_fp32_adapters(tmp_path):
    run_ranks(_run, 2, str(tmp_path))
