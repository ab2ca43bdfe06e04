"""Issue 34's Unsloth row: QLoRA through Unsloth on Qwen3-30B-A3B shapes, for the side-by-side table of LoRA on a
quantized base. Unsloth loads only from a checkpoint on disk, so this writes one first, a layer at a time: random
weights of the shapes (``--layers`` of 48) drawn as transformers initialises them, in transformers' own layout,
bf16 safetensors, with a word-level tokenizer of the real
vocabulary size (no hub here), in ``--ckpt`` (default /dev/shm: 48 layers take 61 GB, which RAM holds and the
machine's disk may not). Then, as Unsloth's documentation shows it: ``FastLanguageModel.from_pretrained(...,
load_in_4bit=True)``, ``get_peft_model`` with rank 16 on attention and the MLP projections, Unsloth's gradient
checkpointing, AdamW; ``--steps`` micro-batch-1 steps of random tokens at ``--seq-len``.

Prints stage lines, then one JSON row: tokens/s (median of the steps after ``--warmup``), peak GiB allocated and
reserved, the losses, the trained parameter count, and what was quantized: parameter elements by class and dtype,
the experts' apart (bitsandbytes quantizes ``nn.Linear`` weights; transformers' fused 3-D experts are no
``nn.Linear``: benchmarks/bnb_fused_experts.py).

Unsloth and its dependencies are not on the GPU machines and have no network there: they travel as one archive
made here (``--site`` is the folder it unpacks to, appended to sys.path so the machine's own torch, transformers,
peft and accelerate stay first):

    pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform any -d wheels \
      unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 xformers==0.0.35 torchao==0.18.0 \
      cut_cross_entropy tyro docstring_parser typeguard msgspec structlog json5 hf_transfer diffusers \
      datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 xxhash trl==1.15.0 sentencepiece nest_asyncio rich \
      pydantic pydantic_core annotated_types typing_inspection typer click shellingham markdown_it_py mdurl \
      pygments importlib_metadata zipp pillow regex
    # unpacked into one folder; Unsloth Studio's web app (studio/, 82 MB) and bitsandbytes' libraries for
    # other CUDA versions removed: 40 MB gzipped, inside the 64 MiB a device call carries
    python benchmarks/unsloth_qlora.py --site /tmp/uns_site --layers 48 --out <dir>/unsloth.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

T0 = time.time()


def say(*parts) -> None:
    print(f"[{time.time() - T0:7.1f}s]", *parts, flush=True)


def write_checkpoint(path: str, layers: int, overrides: dict | None = None) -> None:
    """Qwen3-30B-A3B's config with ``layers`` layers (``overrides`` of its other keys: tests), random bf16 weights,
    and a tokenizer, saved in ``path``, one safetensors shard per layer. transformers saves a model of one layer
    first, so the keys and the on-disk layout are its own; every further layer is drawn anew as transformers
    initialises it (normal, std ``initializer_range``; norms 1). The whole model is never in memory at once: saved
    at once, its 61 GB plus the save's conversion overflowed an 80 GB GPU, and the host holds it in /dev/shm."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from moe_tune.models.presets import preset_config

    def config(num_layers: int):  # the shapes of moe_tune's rows
        cfg = preset_config("qwen3_30b_a3b", {**(overrides or {}), "num_hidden_layers": num_layers})
        cfg.eos_token_id, cfg.pad_token_id = cfg.vocab_size - 1, cfg.vocab_size - 2
        return cfg

    cfg = config(1)
    vocab = cfg.vocab_size
    seed_dir = path + ".one_layer"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(seed_dir)
    tensors = {}
    for name in sorted(os.listdir(seed_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(seed_dir, name), "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    layer0 = {k.removeprefix("model.layers.0."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    rest = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    os.makedirs(path, exist_ok=True)
    shards = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
    weight_map = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 30B numbers on the host takes minutes
    gen = torch.Generator(device).manual_seed(0)
    for i in range(layers):
        layer = {}
        for k, v in layer0.items():
            if i == 0 or k.endswith("norm.weight"):
                layer[f"model.layers.{i}.{k}"] = v
            else:
                drawn = torch.randn(v.shape, generator=gen, device=device, dtype=torch.float32)
                layer[f"model.layers.{i}.{k}"] = (drawn * cfg.initializer_range).to(v.dtype).cpu()
        save_file(layer, os.path.join(path, shards[i]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(layer, shards[i]))
    save_file(rest, os.path.join(path, shards[-1]), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, shards[-1]))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config(layers).save_pretrained(path)
    for name in os.listdir(seed_dir):
        os.remove(os.path.join(seed_dir, name))
    os.rmdir(seed_dir)
    words = {f"t{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<|im_end|>": vocab - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(path)


def quantized_census(model) -> dict[str, float]:
    """Millions of parameter elements by (class, dtype, expert or not)."""
    out: dict[str, float] = {}
    for name, p in model.named_parameters():
        key = f"{type(p).__name__} {str(p.dtype).removeprefix('torch.')} {'experts' if '.experts.' in name else 'rest'}"
        out[key] = out.get(key, 0.0) + p.numel() / 1e6
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def train(args) -> dict:
    import torch
    import unsloth
    from unsloth import FastLanguageModel

    say("unsloth", unsloth.__version__, "torch", torch.__version__)
    model, _ = FastLanguageModel.from_pretrained(
        args.ckpt, max_seq_length=args.seq_len, load_in_4bit=True, dtype=torch.bfloat16, local_files_only=True
    )
    loaded_gib = torch.cuda.memory_allocated() / 2**30
    census = quantized_census(model)
    say("loaded in 4-bit:", round(loaded_gib, 2), "GiB;", census)
    model = FastLanguageModel.get_peft_model(
        model,
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0,
        target_modules=args.targets.split(","),
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    say("trained parameters:", sum(p.numel() for p in trained) / 1e6, "M")
    opt = torch.optim.AdamW(trained, lr=1e-4)
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    seconds, losses = [], []
    for step in range(args.steps):
        ids = torch.randint(0, 151000, (1, args.seq_len), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.time() - start)
        losses.append(round(loss.item(), 4))
        say(f"step {step + 1}: loss {losses[-1]} {seconds[-1] * 1e3:.0f} ms")
    return {
        "stack": f"unsloth {unsloth.__version__}",
        "layers": args.layers,
        "seq_len": args.seq_len,
        "micro_batch": 1,
        "tokens_per_s": round(args.seq_len / statistics.median(seconds[args.warmup :])),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "loaded_gib": round(loaded_gib, 2),
        "trained_params_m": round(sum(p.numel() for p in trained) / 1e6, 1),
        "params_by_kind_m": census,
        "losses": losses,
        "gpu": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (default /dev/shm/qwen3_moe_<layers>l)")
    parser.add_argument("--site", default=None, help="folder of Unsloth and its dependencies, appended to sys.path")
    parser.add_argument("--out", default=None, help="JSON file for the row")
    args = parser.parse_args(argv)
    if args.site:
        sys.path.append(args.site)
    args.ckpt = args.ckpt or f"/dev/shm/qwen3_moe_{args.layers}l"
    import unsloth  # noqa: F401  (before transformers, which it patches as it is imported)

    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        write_checkpoint(args.ckpt, args.layers)
        say("checkpoint written:", args.ckpt)
    row = train(args)
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
