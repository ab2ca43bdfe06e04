"""``kernels.cuda_graphs=true`` on a GPU: the compiled layers replayed as CUDA graphs train exactly as the same
compiled layers launched one kernel at a time (the graphs hold the same kernels), with and without activation
checkpointing, and no layer falls back to launching without a graph."""

from __future__ import annotations

import pytest
import torch

from moe_tune.cli.train import compose, to_config

STEPS = 4


def _losses(tmp_path, name: str, extra: list[str]) -> tuple[list[float], list[float], dict]:
    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    overrides = [
        f"output_dir={tmp_path / name}",
        "checkpoint.export_hf=false",
        "train.seq_len=64",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",  # two micro-batches: a graph replayed within one step
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
    return losses, norms, {"skips": dict(torch._dynamo.utils.counters["inductor"]), "counts": counts}


@pytest.mark.gpu
@pytest.mark.parametrize("ac", ["none", "full"])
def test_cuda_graphs_train_as_the_compiled_layers(tmp_path, ac):
    plain = _losses(tmp_path, "plain", [f"parallel.activation_checkpointing={ac}"])
    graphs = _losses(tmp_path, "graphs", [f"parallel.activation_checkpointing={ac}", "kernels.cuda_graphs=true"])
    assert graphs[2]["skips"].get("cudagraph_skips", 0) == 0, graphs[2]["skips"]
    assert graphs[0] == plain[0], (graphs[0], plain[0])  # losses, step by step
    assert graphs[1] == plain[1], (graphs[1], plain[1])  # gradient norms
    assert torch.equal(graphs[2]["counts"], plain[2]["counts"])  # the routing counts kept past the graphs' replay
    assert plain[0][-1] < plain[0][0]  # the steps trained
