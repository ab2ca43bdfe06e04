"""What bitsandbytes' 4-bit loading in Transformers quantizes in a MoE (issue 34's side-by-side row, before a GPU):
a tiny Qwen3-MoE checkpoint loaded with ``BitsAndBytesConfig(load_in_4bit=True, nf4)``, each parameter's class,
dtype and shape, and the share of the weights left in bf16. Runs on a CPU (bitsandbytes >= 0.48 has a CPU backend).

    python benchmarks/bnb_fused_experts.py > benchmarks/results/<dir>/bnb_fused_experts.txt
"""

from __future__ import annotations

import tempfile

import torch


def main() -> None:
    import bitsandbytes
    import transformers
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.tiny import save_tiny

    path = save_tiny(tempfile.mkdtemp() + "/tiny", "qwen3_moe", torch.bfloat16, 0)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")
    print(
        f"transformers {transformers.__version__}, bitsandbytes {bitsandbytes.__version__}, torch {torch.__version__}"
    )
    quantized = kept = 0
    for name, p in model.named_parameters():
        is_4bit = type(p).__name__ == "Params4bit"
        count = p.numel() * (2 if is_4bit else 1)  # two 4-bit values per stored byte
        quantized, kept = quantized + count * is_4bit, kept + count * (not is_4bit)
        if ".layers.0." in name:
            print(f"{name}: {type(p).__name__} {p.dtype} {tuple(p.shape)}")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"weights quantized to 4 bits: {quantized}; left as they were: {kept} (of which routed experts: {experts})")


if __name__ == "__main__":
    main()
