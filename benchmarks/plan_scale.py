"""On paper, toward scale: moe-tune-plan's layouts for Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 on 8-128 H200s.

For each model, mode (full fine-tuning, LoRA rank 16 on attention and experts) and GPU count, the planner's search
over expert parallelism (8 GPUs per node: ep in 8, 16, 32, 64 where it divides the GPUs and the experts),
activation checkpointing and micro-batch (1-8), seq 4096, bf16 parameters with stochastic-rounding AdamW
(train.precision=bf16: the fp32 master weights of a 235B model need 16 bytes per parameter before any activation),
compiled layers, all_to_all dispatch, real routing (and the chosen layout's speed under forced balanced routing,
as NVIDIA's published tables measure). Prints the fastest layout that fits each, in Markdown:

    python benchmarks/plan_scale.py > benchmarks/results/<dir>/plan_scale.md

The links beyond one node are the planner's assumption (speed.Links: 45 GB/s per GPU); the rates are the H200's
fitted to the one-node rows. Qwen3-235B-A22B is Qwen3-30B-A3B's family with the published 235B shape.
"""

from __future__ import annotations

import sys
import time

QWEN3_235B = [
    "++model.overrides.hidden_size=4096",
    "++model.overrides.num_hidden_layers=94",
    "++model.overrides.num_attention_heads=64",
    "++model.overrides.num_key_value_heads=4",
    "++model.overrides.head_dim=128",
    "++model.overrides.moe_intermediate_size=1536",
    "++model.overrides.intermediate_size=12288",
    "++model.overrides.num_experts=128",
    "++model.overrides.num_experts_per_tok=8",
]
MODELS = {
    "Qwen3-30B-A3B": ["model=qwen3_30b_a3b"],
    "Qwen3-235B-A22B": ["model=qwen3_30b_a3b", *QWEN3_235B],
    # the built-in deepseek_v3 is cut to 4 layers: the published 61 (3 dense)
    "DeepSeek-V3": [
        "model=deepseek_v3",
        "model.overrides.num_hidden_layers=61",
        "model.overrides.first_k_dense_replace=3",
    ],
}
MODES = {"full": [], "LoRA": ["peft=lora"]}
WORKS = [
    ("Qwen3-30B-A3B", "full"),
    ("Qwen3-30B-A3B", "LoRA"),
    ("Qwen3-235B-A22B", "full"),
    ("Qwen3-235B-A22B", "LoRA"),
    ("DeepSeek-V3", "LoRA"),
]
GPUS = (8, 16, 64, 128)
COMMON = ["train.seq_len=4096", "train.precision=bf16", "kernels.compile=true", "comm=all_to_all"]


def best(overrides: list[str], gpus: int):
    """The fastest fitting plan over ep (8, 16, 32, 64), checkpointing and micro-batch 1-8; None if none fits."""
    from moe_tune.config import ConfigError
    from moe_tune.config.overrides import check, to_config
    from moe_tune.plan import search

    fitting = []
    for ep in (8, 16, 32, 64):
        if gpus % ep:
            continue
        cfg = to_config(check([*overrides, f"parallel.ep={ep}"]))
        try:
            fits, _ = search(
                cfg, gpus, max_micro_batch=8, vary=("parallel.activation_checkpointing", "train.micro_batch_size")
            )
        except ConfigError:
            continue
        fitting += fits
    fitting.sort(key=lambda p: -p.speed["tokens_per_s_per_gpu"])
    return fitting[0] if fitting else None


def main() -> None:
    print(
        "| model | mode | GPUs | layout | peak GiB per GPU | predicted tokens/s per GPU (real routing) | "
        "the same, forced balanced routing | communication share |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for name, mode in WORKS:
        for gpus in GPUS:
            t = time.perf_counter()
            p = best([*MODELS[name], *MODES[mode], *COMMON], gpus)
            print(f"  {name} {mode} {gpus}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
            if p is None:
                print(f"| {name} | {mode} | {gpus} | none fits | | | | |", flush=True)
                continue
            d = p.as_dict()
            from moe_tune.plan import plan

            balanced = plan(p.config, gpus, routing="balanced", hf_config=p.hf_config).speed["tokens_per_s_per_gpu"]
            lay = d["layout"]
            layout = f"ep={lay['ep']} (efsdp={lay['efsdp']}), mb={lay['micro_batch_size']}, ac={lay['activation_checkpointing']}"
            print(
                f"| {name} | {mode} | {gpus} | {layout} | {d['peak_gib']:.1f} | {d['tokens_per_s_per_gpu']:,.0f} | "
                f"{balanced:,.0f} | {d['communication_share']:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
