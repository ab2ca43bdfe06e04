"""``moe-tune-export CHECKPOINT OUT``: a training checkpoint (``checkpoints/step_<N>``) to a Hugging Face
directory. Runs in one process on the CPU; the checkpoint may come from any parallel layout."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-tune-export", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoints/step_<N> directory written by moe-tune")
    parser.add_argument("out", help="output directory for the Hugging Face checkpoint")
    args = parser.parse_args(argv)
    from moe_tune.config import UserError

    try:
        export(args.checkpoint, args.out)
    except UserError as e:
        print(f"moe-tune-export: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {args.out}")


def export(checkpoint: str, out: str) -> None:
    import torch

    from moe_tune.build import from_checkpoint
    from moe_tune.models.export import write_checkpoint_atomic

    model, cfg = from_checkpoint(checkpoint)
    # OUT is replaced as a whole: no file of an earlier export into it remains
    write_checkpoint_atomic(model, out, dtype=None if cfg.model.dtype == "source" else getattr(torch, cfg.model.dtype))


if __name__ == "__main__":
    main()
