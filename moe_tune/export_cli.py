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
    # One CPU process, no expert parallelism: every layout resumes into this one.
    cfg.parallel.ep, cfg.parallel.dp_shard, cfg.parallel.dp_replicate = 1, -1, 1
    cfg.comm.name, cfg.kernels.name, cfg.kernels.fp8 = "all_to_all", "torch", "none"
    cfg.checkpoint.resume = checkpoint
    cfg.train.precision = "fp32" if cfg.train.precision != "bf16" else "bf16"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    from moe_tune.train import Trainer

    if meta.get("source") and os.path.isfile(os.path.join(meta["source"], "config.json")):
        cfg.model.path = meta["source"]
    cfg.output_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    trainer = Trainer(cfg, write_run_files=False)
    trainer.export(out)


if __name__ == "__main__":
    main()
