"""``moe-tune-export CHECKPOINT OUT [--merge]``: a training checkpoint (``checkpoints/step_<N>``) to a Hugging Face
directory; for a LoRA run a PEFT adapter directory, or with --merge the full model with the adapters merged in.
Runs in one process on the CPU; the checkpoint may come from any parallel layout. OUT is replaced as a whole, so
it must be new, empty or an earlier export; a model directory moe-tune-export did not write, or the model a
checkpoint of the run was trained from, is replaced only with --overwrite."""

from __future__ import annotations

import argparse
import json
import os
import sys

from moe_tune.cli import described


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-tune-export", description=described(__doc__))
    parser.add_argument("checkpoint", help="a checkpoints/step_<N> directory written by moe-tune")
    parser.add_argument("out", help="output directory for the Hugging Face checkpoint")
    parser.add_argument(
        "--merge", action="store_true", help="LoRA runs: write the full model with the adapters merged in"
    )
    parser.add_argument(
        "--base", default=None, help="LoRA runs: the base model's directory, if it is no longer where the run read it"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT even if it is a model directory moe-tune-export did not write, or a checkpoint's base",
    )
    args = parser.parse_args(argv)
    from moe_tune.config import UserError

    try:
        export(args.checkpoint, args.out, merge=args.merge, base=args.base, overwrite=args.overwrite)
    except UserError as e:
        print(f"moe-tune-export: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # a full disk: one line and exit 1, as a run's checkpoint save says it
        from moe_tune.checkpoint.safe import export_disk_full

        kept, again = f"the checkpoint {args.checkpoint} is intact", "run the same moe-tune-export command again"
        line = export_disk_full(e, args.out, kept, again)
        if line is None:
            raise
        print(f"moe-tune-export: error: {line}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {args.out}")


def export(checkpoint: str, out: str, merge: bool = False, base: str | None = None, overwrite: bool = False) -> None:
    import torch

    from moe_tune.build import from_checkpoint
    from moe_tune.config import ConfigError
    from moe_tune.models.export import check_replaceable, write_checkpoint_atomic
    from moe_tune.models.lora import has_lora, merge_lora
    from moe_tune.models.peft_export import write_adapter

    # Before the checkpoint is read: an export replaces OUT as a whole
    check_replaceable(out, checkpoint_sources(checkpoint, base), overwrite)
    model, cfg = from_checkpoint(checkpoint, base=base)
    dtype = None if cfg.model.dtype == "source" else getattr(torch, cfg.model.dtype)
    lora = has_lora(model)
    if merge and not lora:
        raise ConfigError(
            f"--merge applies to LoRA runs; {checkpoint} is from a full fine-tune (peft={cfg.peft.name}), whose "
            "export is the whole model already: drop --merge"
        )
    if base is not None and not lora:  # a full fine-tune's checkpoint holds every weight: --base would be unused
        raise ConfigError(f"--base applies to LoRA runs; {checkpoint} is from a full fine-tune: drop --base {base}")
    if merge:
        merge_lora(model)
    with open(os.path.join(checkpoint, "meta.json")) as f:  # read and checked by from_checkpoint
        chat_template = json.load(f).get("chat_template")  # data.chat_template's text, as training used it
    # OUT is replaced as a whole: no file of an earlier export into it remains
    writer = write_adapter if lora and not merge else None
    write_checkpoint_atomic(model, out, writer=writer, dtype=dtype, chat_template=chat_template)


def checkpoint_sources(checkpoint: str, base: str | None) -> dict[str, str]:
    """The model directories that ``checkpoint`` and the other checkpoints of its run read (meta.json's
    ``source``; ``base``), each with the checkpoint that reads it. A meta.json that cannot be read names none
    (``from_checkpoint`` says what is wrong with it)."""
    import glob

    sources = {base: checkpoint} if base else {}
    siblings = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "step_*")))
    for path in [checkpoint, *siblings]:
        try:
            with open(os.path.join(path, "meta.json")) as f:
                source = json.load(f).get("source")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(source, str):
            sources.setdefault(source, path)
    return sources


if __name__ == "__main__":
    main()
