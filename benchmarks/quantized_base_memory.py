"""On paper: the largest MoE each ``peft.quantize_base`` mode fits for LoRA, per machine (issue 34's memory table),
from moe-tune-plan's memory model (``moe_tune.plan``: the run's own build on the meta device, activations measured
on one layer, constants calibrated against the committed H200 rows; benchmarks/README.md "Planning a run").

Workload: LoRA rank 16 (alpha 32) on the attention and the routed experts, seq 4096, micro-batch 1, full activation
checkpointing, compiled layers, real routing; the adapters in ``train.precision=bf16_fp32_master`` (fp32 master
weights and AdamW moments: 16 bytes per adapter parameter with the bf16 copy and the gradient) and in
``train.precision=bf16`` (bf16 adapters and moments, stochastic rounding). One GPU: the whole model on it; 8 GPUs:
expert parallelism 8 with FSDP2 over the rest. A layout fits when the planner's reserved memory (the allocator's
peak with its fragmentation, the CUDA context) stays within the GPU less 5%: an 80 GB GPU (79.6 GiB: an H100's
81,559 MiB) and an H200 (140.4 GiB). Printed as Markdown:

    python benchmarks/quantized_base_memory.py > benchmarks/results/<dir>/memory_model.md
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from plan_scale import MODELS as SCALE_MODELS

MODELS = {
    "Qwen3-30B-A3B": SCALE_MODELS["Qwen3-30B-A3B"],
    "Mixtral-8x7B": ["model=mixtral_8x7b"],
    "GLM-4.5-Air": ["model=glm4_5_air"],
    "Qwen3-235B-A22B": SCALE_MODELS["Qwen3-235B-A22B"],
    "DeepSeek-V3": SCALE_MODELS["DeepSeek-V3"],
}
MODES = ("none", "fp8", "nf4")
PRECISIONS = ("bf16_fp32_master", "bf16")
GPU_MEM_GIB = {"1 x 80 GB": 79.6, "1 x H200": 140.4}
LORA = [
    "peft=lora",
    "peft.rank=16",
    "peft.alpha=32",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "parallel.activation_checkpointing=full",
    "kernels.compile=true",
]
HEADROOM = 0.05


def reserved_gib(overrides: list[str], gpus: int) -> float | None:
    """The planner's reserved memory per GPU (GiB), or None for a layout that cannot run. Each plan runs in a fresh
    process: one process planning every row grew past the 24 GiB development machine's memory at DeepSeek-V3."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_reserved_gib, overrides, gpus).result()


def _reserved_gib(overrides: list[str], gpus: int) -> float | None:
    from moe_tune.config import ConfigError
    from moe_tune.config.overrides import check, to_config
    from moe_tune.plan import plan

    try:
        return plan(to_config(check(overrides)), gpus).as_dict()["reserved_gib"]
    except ConfigError:
        return None


def main() -> None:
    machines = [*GPU_MEM_GIB, "8 x H200"]
    print("| model | base | adapters | " + " | ".join(machines) + " |")
    print("|---|---|---|" + "---:|" * len(machines))
    largest: dict[tuple[str, str, str], str] = {}
    for name, model in MODELS.items():  # smallest to largest
        for mode in MODES:
            for precision in PRECISIONS:
                common = [*model, *LORA, f"peft.quantize_base={mode}", f"train.precision={precision}"]
                t = time.perf_counter()
                one = reserved_gib(common, 1)
                eight = reserved_gib([*common, "parallel.ep=8"], 8)
                print(f"  {name} {mode} {precision}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
                cells = []
                for machine, (need, capacity) in zip(
                    machines, [(one, GPU_MEM_GIB["1 x 80 GB"]), (one, GPU_MEM_GIB["1 x H200"]), (eight, 140.4)]
                ):
                    fits = need is not None and need <= (1 - HEADROOM) * capacity
                    if fits:
                        largest[machine, mode, precision] = name
                    cells.append("cannot run" if need is None else f"{need:.1f} GiB, {'fits' if fits else 'no'}")
                print(f"| {name} | {mode} | {precision} | " + " | ".join(cells) + " |", flush=True)
    print("\nThe largest of these each mode fits:\n")
    print("| base | adapters | " + " | ".join(machines) + " |")
    print("|---|---|" + "---|" * len(machines))
    for mode in MODES:
        for precision in PRECISIONS:
            row = [largest.get((m, mode, precision), "none") for m in machines]
            print(f"| {mode} | {precision} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
