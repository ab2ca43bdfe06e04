"""``moe-tune-plan [overrides] [--gpus N] [--gpu-mem-gib G] [--search] [--json]``: what a run will cost per GPU,
before it is launched, on any machine (CPU only is enough).

Takes ``moe-tune``'s own overrides. Prints the predicted peak memory per rank (``peak_gib``: the step's
``torch.cuda.max_memory_allocated``) with its parts, whether it fits, and the predicted tokens/s per GPU. With
``--search``: every layout of ``--gpus`` GPUs (expert parallelism, micro-batch, activation checkpointing) that fits,
fastest first, and why each other one does not; those of the three keys given a value are held at it. A key given as
``auto`` (as ``moe-tune`` takes it) is searched the same way. Exit 2 for a configuration that cannot run, as
``moe-tune``; 3 when the layout does not fit (with ``--search``: when none does), so that a script can branch on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from moe_tune.cli import described, quiet_on_closed_pipe
from moe_tune.config import UserError
from moe_tune.config.override_forms import expand_home
from moe_tune.config.overrides import AUTO_KEYS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-tune-plan", description=described(__doc__.split("\n\n")[0].replace("\n", " "))
    )
    p.add_argument("overrides", nargs="*", help="moe-tune's overrides (model=..., parallel.ep=..., train....)")
    p.add_argument("--gpus", type=int, default=None, help="world size (default: the layout's, as moe-tune's launch)")
    p.add_argument("--gpu-mem-gib", type=float, default=None, help="memory per GPU (default: an H200's 140.4)")
    p.add_argument("--headroom", type=float, default=None, help="share of each GPU left free (default 0.05)")
    p.add_argument("--routing", choices=("real", "balanced"), default="real", help="expected routing imbalance")
    p.add_argument(
        "--search", action="store_true", help="list the layouts that fit, fastest first (keys given are held)"
    )
    p.add_argument("--max-micro-batch", type=int, default=16, help="largest micro-batch --search tries (default 16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _row(d: dict) -> str:
    lay = d["layout"]
    return (
        f"ep={lay['ep']:<3} mb={lay['micro_batch_size']:<3} ac={lay['activation_checkpointing']:<9} "
        f"{d['peak_gib']:7.1f} GiB  {d['tokens_per_s_per_gpu']:10,.0f} tokens/s/GPU  "
        f"comm {d['communication_share']:.0%}"
    )


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _model_line(d: dict) -> str:
    shape = d["shape"]
    return (
        f"{d['model']} ({shape['layers']} layers, {shape['moe_layers']} of them MoE: {shape['experts']} experts, "
        f"top-{shape['top_k']}; hidden {shape['hidden']}, vocab {shape['vocab']:,}; "
        f"{_billions(shape['params'])} parameters, {_billions(shape['active_params'])} active per token)"
    )


def _print_plan(d: dict) -> None:
    lay = d["layout"]
    print(_model_line(d))
    print(
        f"on {d['gpus']} GPU(s) of {d['gpu_mem_gib']:g} GiB: dp_replicate={lay['dp_replicate']} "
        f"dp_shard={lay['dp_shard']} ep={lay['ep']} (efsdp={lay['efsdp']}), micro-batch {lay['micro_batch_size']} x "
        f"{lay['seq_len']}, activation_checkpointing={lay['activation_checkpointing']}, comm={lay['comm']}, "
        f"compile={lay['compile']}, {lay['precision']}, peft={lay['peft']}"
        + (f" (base {lay['quantize_base']})" if lay["quantize_base"] != "none" else "")
    )
    print(f"peak memory per GPU (max_memory_allocated): {d['peak_gib']:.1f} GiB ({d['routing']} routing)")
    for k, v in d["breakdown_gib"].items():
        print(f"  {k:<28} {v:8.2f} GiB")
    if d["worst_case_routing_peak_gib"] > d["peak_gib"] + 0.05:
        print(f"  worst-case routing peak     {d['worst_case_routing_peak_gib']:8.2f} GiB (every token to this rank)")
    print(
        f"reserved with context and comm buffers: {d['reserved_gib']:.1f} GiB -> {'fits' if d['fits'] else 'does NOT fit'}"
    )
    for problem in d["problems"]:
        print(f"  {problem}")
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in d["step_parts_s"].items() if v > 0)
    print(f"predicted {d['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, step {d['step_s'] * 1e3:.0f} ms ({parts})")
    if lay["kernels"] == "te":
        print("  kernels=te: TransformerEngine's layers are not modelled, predicted as the torch path they replace")
    if lay["quantize_base"] != "none":
        print(
            f"  the speed counts the {lay['quantize_base']} base's GEMMs as bf16's: measured (Qwen3-30B-A3B LoRA, "
            "full checkpointing, bf16 adapters) fp8 0.94-0.98x and nf4 0.65-0.71x the bf16 base's tokens/s on one "
            "H100, fp8 0.79x and nf4 0.87x on one H200 (benchmarks/README.md)"
        )


def _print_search(result: dict, searched: tuple[str, ...]) -> None:
    held = [k for k in AUTO_KEYS if k not in searched]
    given = f" ({', '.join(held)} as given)" if held else ""
    if result["model"]:
        print(_model_line(result["model"]))
    print(f"layouts of {result['gpus']} GPU(s) that fit, fastest first{given}:")
    for d in result["fits"]:
        print("  " + _row(d))
    if not result["fits"]:
        print("  none")
    print("rejected:" + ("" if result["rejected"] else " none"))
    for r in result["rejected"]:
        lay = r["layout"]
        print(f"  ep={lay['ep']} mb={lay['micro_batch_size']} ac={lay['activation_checkpointing']}: {r['reason']}")
    if result["best"]:
        print(f"best: {_layout_overrides(result['best']['layout'])}")
    quantized = result.get("quantized_base")
    if quantized:
        said = (
            f"the frozen experts in {quantized['base'].upper()} and bf16 adapters ({' '.join(quantized['overrides'])})"
        )
        if quantized["best"]:
            best = quantized["best"]
            print(
                f"with {said}, {quantized['fits']} layout(s) fit; best: {_layout_overrides(best['layout'])} "
                f"({best['reserved_gib']:.1f} GiB, {best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU as bf16's)"
            )
        else:
            print(f"none fits with {said} either")


def _layout_overrides(lay: dict) -> str:
    return (
        f"parallel.ep={lay['ep']} train.micro_batch_size={lay['micro_batch_size']} "
        f"parallel.activation_checkpointing={lay['activation_checkpointing']}"
    )


# What a LoRA search that fits nowhere tries next, in order: the frozen experts in FP8 (closer to bf16's loss, half
# the bytes), then in NF4 (about a quarter), each with bf16 adapters (docs/lora.md).
QUANTIZED_BASES = ("fp8", "nf4")


def quantized_base_overrides(base: str) -> list[str]:
    return [f"peft.quantize_base={base}", "train.precision=bf16"]


def _quantized_search(overrides: list[str], gpus: int, mem: float, headroom: float, args, searched) -> dict | None:
    """The same search with the frozen experts quantized and bf16 adapters, for a LoRA run none of whose layouts
    fit on a bf16 base: {"base", "overrides", "fits" (how many), "best"} for the first of ``QUANTIZED_BASES`` with
    a layout that fits, else for the last tried; None where no quantized base can hold this model (its dims)."""
    from moe_tune.config import ConfigError
    from moe_tune.config import overrides as cli_args
    from moe_tune.plan import search

    found = None
    for base in QUANTIZED_BASES:
        try:
            cfg = cli_args.to_config(cli_args.check([*overrides, *quantized_base_overrides(base)]))
            fitting, _ = search(cfg, gpus, mem, headroom, args.routing, args.max_micro_batch, searched)
        except ConfigError:
            continue
        best = fitting[0].as_dict() if fitting else None
        found = {"base": base, "overrides": quantized_base_overrides(base), "fits": len(fitting), "best": best}
        if best:
            break
    return found


def _model_of(fitting: list, cfg, gpus: int, mem: float) -> dict | None:
    """The model as it will be trained ({"model", "shape"}), for the search's first line: from a layout that fits,
    else from the layout as given (None where that cannot run)."""
    from moe_tune.config import ConfigError
    from moe_tune.plan import plan

    try:
        d = fitting[0].as_dict() if fitting else plan(cfg, gpus, mem).as_dict()
    except ConfigError:
        return None
    return {"model": d["model"], "shape": d["shape"]}


def check_flags(args) -> None:
    """The flags' values, before anything is composed (one line, exit 2)."""
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: give a number of GPUs >= 1")
    if args.gpu_mem_gib is not None and not 0 < args.gpu_mem_gib < math.inf:  # nan fails both comparisons
        raise UserError(
            f"--gpu-mem-gib {args.gpu_mem_gib:g}: give each GPU's memory in GiB, a number > 0 (an H200: 140.4)"
        )
    if args.headroom is not None and not 0 <= args.headroom < 1:
        raise UserError(f"--headroom {args.headroom:g}: give the share of each GPU left free, 0 <= headroom < 1")
    if args.max_micro_batch < 1:
        raise UserError(f"--max-micro-batch {args.max_micro_batch}: give the largest micro-batch to try, >= 1")


def searched_keys(overrides: list[str], search: bool) -> tuple[tuple[str, ...] | None, list[str]]:
    """(the layout keys to search, None for a plan of the layout as given; the overrides without ``auto`` values).
    ``auto`` keys are searched; with ``--search`` so is every layout key the overrides do not set."""
    from moe_tune.plan.auto import auto_keys

    auto = auto_keys(overrides)
    given = [o for o in overrides if o.split("=", 1)[0] not in auto]
    if search:
        held = {o.split("=", 1)[0].lstrip("+") for o in given if "=" in o}
        return tuple(k for k in AUTO_KEYS if k not in held), given
    return (tuple(auto) if auto else None), given


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # flags and overrides in any order
    args.overrides = [expand_home(o) for o in args.overrides]  # model.path=~/ckpt as moe-tune reads it
    try:
        from moe_tune.build import check_model_source
        from moe_tune.config import overrides as cli_args
        from moe_tune.plan import DEFAULT_GPU_MEM_GIB, DEFAULT_HEADROOM, plan, quiet_yarn_ratio_warning, search

        check_flags(args)
        searched, overrides = searched_keys(args.overrides, args.search)
        cfg = cli_args.to_config(cli_args.check(overrides))
        with quiet_yarn_ratio_warning():
            check_model_source(cfg, weights=False)  # a missing or unreadable model.path: moe-tune's own one line
        mem = DEFAULT_GPU_MEM_GIB if args.gpu_mem_gib is None else args.gpu_mem_gib
        headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
        if searched is not None:
            from moe_tune.plan import default_gpus

            gpus = args.gpus or default_gpus(cfg)
            fitting, rejected = search(cfg, gpus, mem, headroom, args.routing, args.max_micro_batch, searched)
            result = {
                "gpus": gpus,
                "searched": list(searched),
                "fits": [p.as_dict() for p in fitting],
                "rejected": [{"layout": lay, "reason": why} for lay, why in rejected],
                "best": fitting[0].as_dict() if fitting else None,
                "model": _model_of(fitting, cfg, gpus, mem),
            }
            if not fitting and cfg.peft.name == "lora" and cfg.peft.quantize_base == "none":
                result["quantized_base"] = _quantized_search(overrides, gpus, mem, headroom, args, searched)
        else:
            result = plan(cfg, args.gpus, mem, headroom, args.routing).as_dict()
    except UserError as e:
        print(f"moe-tune-plan: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(result, indent=2))
        elif searched is not None:
            _print_search(result, searched)
        else:
            _print_plan(result)
        sys.stdout.flush()
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a second error at exit's flush
    fits = bool(result["fits"])  # a list of layouts under --search, a bool otherwise
    return 0 if fits else 3


if __name__ == "__main__":
    raise SystemExit(main())
