"""On paper: the largest MoE each ``peft.quantize_base`` mode fits for LoRA, per machine (issue 34's memory table).

Each model is built on the meta device from its config (transformers' own classes: nothing is allocated) and its
parameters counted: routed experts (``.experts.`` tensors) apart from the rest. Per GPU, with ``G`` GPUs, expert
parallelism over all of them and FSDP2 over the rest (one GPU: neither):

    frozen base   experts x bytes(mode) / G + other weights x 2 / G (bf16; with G > 1 one decoder layer's
                  all-gathered weights on top)
    adapters      rank 16 on the attention's linears and the routed experts' two projections, 16 bytes per
                  adapter parameter (fp32 weight, fp32 gradient, two fp32 AdamW moments: bf16_fp32_master), / G
    activations   full activation checkpointing, seq 4096, micro-batch 1: each layer's saved input (2 bytes x
                  seq x hidden x layers) plus one layer's recompute, taken as 3.2 GiB x hidden / 2048 (what
                  the committed bf16-base LoRA row on Qwen3-30B-A3B, 69.6 GiB, leaves after its weights and
                  adapters)
    fits          the sum within 92% of the GPU's memory (the allocator's fragmentation and the CUDA context).

bytes(mode): bf16 2; fp8 1 plus a 4-byte scale per row of ``in`` values; nf4 half a byte plus a 2-byte scale per
64 values. Printed as Markdown.

    python benchmarks/quantized_base_memory.py > benchmarks/results/<dir>/quantized_base_memory.md
"""

from __future__ import annotations

import torch

GIB = 2**30
RANK = 16
SEQ = 4096
MODES = ("bf16", "fp8", "nf4")
MACHINES = {"1 x 80 GB": (1, 80e9), "1 x 141 GB (H200)": (1, 141e9), "8 x 141 GB": (8, 141e9)}
QWEN3_235B = dict(
    hidden_size=4096,
    num_hidden_layers=94,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=1536,
    intermediate_size=12288,
    num_experts=128,
    num_experts_per_tok=8,
)
MODELS = {
    "Qwen3-30B-A3B": ("qwen3_30b_a3b", {}),
    "Mixtral-8x7B": ("mixtral_8x7b", {}),
    "GLM-4.5-Air": ("glm4_5_air", {}),
    "Qwen3-235B-A22B": ("qwen3_30b_a3b", QWEN3_235B),
    "DeepSeek-V3": ("deepseek_v3", {}),
}


def counts(preset: str, overrides: dict) -> dict:
    """Parameter counts of a built-in shape: routed experts, the rest, adapters, and the dims used below."""
    from transformers import AutoModelForCausalLM

    from moe_tune.models.presets import preset_config

    config = preset_config(preset, overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = other = adapters = 0
    largest_layer = 0
    for layer in model.model.layers:
        layer_other = 0
        for name, p in layer.named_parameters():
            if ".experts." in name:
                experts += p.numel()
                # gate_up [E, 2I, D] or down [E, D, I]: an adapter pair per expert, rank x (in + out)
                e, a, b = p.shape
                adapters += e * RANK * (a + b)
            else:
                layer_other += p.numel()
                if "self_attn" in name and p.dim() == 2:
                    adapters += RANK * sum(p.shape)
        other += layer_other
        largest_layer = max(largest_layer, layer_other)
    other += sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    return dict(
        experts=experts,
        other=other,
        adapters=adapters,
        largest_layer=largest_layer,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        expert_in=config.hidden_size,
    )


def per_gpu_bytes(c: dict, mode: str, gpus: int) -> float:
    expert_bytes = {"bf16": 2.0, "fp8": 1.0 + 4.0 / c["expert_in"], "nf4": 0.5 + 2.0 / 64}[mode]
    base = c["experts"] * expert_bytes / gpus + c["other"] * 2.0 / gpus
    if gpus > 1:
        base += c["largest_layer"] * 2.0
    adapters = c["adapters"] * 16.0 / gpus
    activations = 2.0 * SEQ * c["hidden"] * c["layers"] + 3.2 * GIB * c["hidden"] / 2048
    return base + adapters + activations


def main() -> None:
    rows = {name: counts(*spec) for name, spec in MODELS.items()}
    print("| model | experts / other / adapter params (B) | mode | " + " | ".join(MACHINES) + " |")
    print("|---|---|---|" + "---:|" * len(MACHINES))
    largest: dict[tuple[str, str], str] = {}
    for name, c in rows.items():  # smallest to largest
        params = f"{c['experts'] / 1e9:.1f} / {c['other'] / 1e9:.1f} / {c['adapters'] / 1e9:.2f}"
        for mode in MODES:
            cells = []
            for machine, (gpus, capacity) in MACHINES.items():
                need = per_gpu_bytes(c, mode, gpus)
                fits = need <= 0.92 * capacity
                if fits:
                    largest[machine, mode] = name
                cells.append(f"{need / GIB:.0f} GiB, {'fits' if fits else 'no'}")
            print(f"| {name} | {params} | {mode} | " + " | ".join(cells) + " |")
    print("\nThe largest of these each mode fits:\n")
    print("| mode | " + " | ".join(MACHINES) + " |")
    print("|---|" + "---|" * len(MACHINES))
    for mode in MODES:
        print(f"| {mode} | " + " | ".join(largest.get((m, mode), "none") for m in MACHINES) + " |")


if __name__ == "__main__":
    main()
