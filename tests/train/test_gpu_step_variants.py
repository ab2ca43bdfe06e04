"""The step's GPU-only variant trains exactly as the plain compiled step: ``optim.overlap_forward=true`` (the update
on a side stream beside the next forward: the same kernels per parameter, so any race with the forward would show),
with and without activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from moe_tune.cli.train import compose, to_config

STEPS = 4
PLAIN: dict[str, tuple] = {}


def _losses(tmp_path, name: str, extra: list[str]) -> tuple[list[float], list[float], dict]:
    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    torch._dynamo.reset()
    overrides = [
        f"output_dir={tmp_path / name}",
        "checkpoint.export_hf=false",
        "train.seq_len=64",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",  # two micro-batches: the update waits for both
        "data.num_samples=64",
        "train.precision=bf16",
        "kernels.compile=true",
        *extra,
    ]
    trainer = Trainer(to_config(compose(overrides)))
    try:
        outs = [trainer.train_step(step) for step in range(STEPS)]
        losses = [float(o["loss"]) for o in outs]
        norms = [float(o["grad_norm"]) for o in outs]
        counts = trainer.train_step(STEPS)["moe_stats"].counts_LE().cpu()
    finally:
        destroy_distributed()
    return losses, norms, {"counts": counts}


@pytest.mark.gpu
@pytest.mark.parametrize("ac", ["none", "full"])
def test_gpu_overlapped_update_trains_as_the_plain_step(tmp_path, ac):
    if ac not in PLAIN:  # the plain step's run, once per activation checkpointing
        PLAIN[ac] = _losses(tmp_path, "plain", [f"parallel.activation_checkpointing={ac}"])
    plain = PLAIN[ac]
    other = _losses(tmp_path, "variant", [f"parallel.activation_checkpointing={ac}", "optim.overlap_forward=true"])
    assert other[0] == plain[0], (other[0], plain[0])  # losses, step by step
    assert other[1] == plain[1], (other[1], plain[1])  # gradient norms
    assert torch.equal(other[2]["counts"], plain[2]["counts"])  # the routing counts
    assert plain[0][-1] < plain[0][0]  # the steps trained
