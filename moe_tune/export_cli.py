"""``moe-tune-export CHECKPOINT OUT``: a training checkpoint (``checkpoints/step_<N>``) to a Hugging Face
directory. Runs in one process on the CPU; the checkpoint may come from any parallel layout."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-tune-export", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoints/step_<N> directory written by moe-tune")
    parser.add_argument("out", help="output directory for the Hugging Face checkpoint")
    args = parser.parse_args(argv)
    from moe_tune.config import ConfigError

    try:
        export(args.checkpoint, args.out)
    except ConfigError as e:
        print(f"moe-tune-export: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {args.out}")


def export(checkpoint: str, out: str) -> None:
    from omegaconf import OmegaConf

    from moe_tune.checkpoint import COMPLETE
    from moe_tune.config import Config, ConfigError

    meta_path = os.path.join(checkpoint, "meta.json")
    if not os.path.isfile(os.path.join(checkpoint, COMPLETE)) or not os.path.isfile(meta_path):
        raise ConfigError(f"{checkpoint} is not a complete moe-tune checkpoint (needs meta.json and {COMPLETE})")
    with open(meta_path) as f:
        meta = json.load(f)
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), meta["config"]))
    import torch
    from transformers import AutoConfig

    from moe_tune.checkpoint import load_model_weights
    from moe_tune.models.export import write_checkpoint
    from moe_tune.models.model import build_model, materialize
    from moe_tune.models.presets import preset_config

    # One CPU process, no parallelism: checkpoints store experts one per key, so any layout loads here.
    # Only the model's weights are read (not the optimizer state), straight into a meta-built model.
    source = meta.get("source")
    if source and not os.path.isfile(os.path.join(source, "config.json")):
        source = None
    hf_config = AutoConfig.from_pretrained(source) if source else preset_config(cfg.model.name, cfg.model.overrides)
    model = build_model(hf_config, dtype=torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)
    model.source_dir = source
    materialize(model, "cpu")
    load_model_weights(model, checkpoint)
    write_checkpoint(model, out, dtype=None if cfg.model.dtype == "source" else getattr(torch, cfg.model.dtype))


if __name__ == "__main__":
    main()
