"""``moe-tune-bench`` = ``python -m moe_tune.bench``: one workload through the plain Transformers baseline,
moe_tune variants and (when installed) NeMo AutoModel, side by side.

    moe-tune-bench model=qwen3_30b_a3b +model.overrides.num_hidden_layers=8 train.seq_len=4096 \\
        train.micro_batch_size=1 train.steps=20 train.warmup_steps_excluded=5 \\
        --variants 'a2a:comm=all_to_all,parallel.ep=2;deepep:comm=deepep,parallel.ep=2' --nproc 2

Positional arguments are moe_tune's Hydra overrides, shared by every row (the workload). Each row runs in its
own process group lifetime (``torchrun --standalone`` or, for one process, plain ``python -m``), writing
``<out>/runs/<stamp>/<variant>/{metrics.jsonl,summary.json,stdout.log,stderr.log}``; a row that fails is
recorded as ``oom`` or ``error: <reason>`` and the benchmark goes on. Results: ``<out>/bench-<stamp>.json``
(its fields: benchmarks/README.md), ``.md`` (table) and ``.png`` (chart) beside it; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import sys
import time

from moe_tune.bench.plans import (
    BASELINES,
    TRL_ATTENTION,
    Plan,
    args_problem,
    build_plans,
    experts_arg,
    parse_variants,
    plans_problem,
)
from moe_tune.bench.runner import Row, run_row, split_overrides
from moe_tune.bench.workload import (
    PEAK_SOURCE,
    compose_config,
    finish_rows,
    row_config,
    variant_problem,
    with_defaults,
    workload,
)
from moe_tune.cli import described


def _default_nproc() -> int:
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(
        prog="moe-tune-bench",
        description=described(" ".join(summary.split())),
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides shared by every row (the workload)")
    p.add_argument(
        "--variants", default=None, help="'name:k=v,k=v;k=v' moe_tune variants (default: one, as given; none: no row)"
    )
    p.add_argument(
        "--baselines",
        default="grouped_mm,eager",
        help=f"plain Transformers rows, comma-separated: {', '.join(BASELINES)} (_nofsdp: without FSDP2, one "
        "process; trl: TRL's SFTTrainer on data.path's records, one process; bnb4: peft=lora on bitsandbytes 4-bit "
        "linears, one process), or none",
    )
    p.add_argument(
        "--trl-attn",
        default="auto",
        choices=TRL_ATTENTION,
        help="the trl row's attention (auto: flex_attention on a GPU at micro-batch 1, else sdpa; logged)",
    )
    p.add_argument(
        "--reference", default=None, help="row whose loss curve the others are compared with (default: first baseline)"
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks per row (default: number of GPUs, 1 on CPU)")
    p.add_argument("--peer", choices=("none", "automodel"), default="none", help="add a NeMo AutoModel row")
    p.add_argument("--peer-dispatcher", default="torch", help="NeMo AutoModel MoE dispatcher: torch or deepep")
    p.add_argument(
        "--peer-ep", type=int, default=None, help="NeMo AutoModel EP size (default: parallel.ep, else nproc)"
    )
    p.add_argument("--peer-backend", default="", help="NeMo BackendConfig overrides, e.g. attn=te,linear=te")
    p.add_argument("--peer-pythonpath", default=None, help="prepended to PYTHONPATH for the peer row only")
    p.add_argument("--routing", choices=("real", "forced_balanced"), default=None, help="default: the overrides'")
    p.add_argument("--out", default=None, help="default: benchmarks/results/<date>-<hardware>")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per row")
    p.add_argument("--dry-run", action="store_true", help="print each row's command and exit")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: datasheet)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from moe_tune.bench.report import hardware_label, write_report
    from moe_tune.run_record import write_json

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if problem := args_problem(args):
        print(f"moe-tune-bench: error: {problem}", file=sys.stderr)
        return 2
    nproc = args.nproc or _default_nproc()
    common = with_defaults(list(args.overrides))
    if args.routing is not None:
        common.append(f"train.force_balanced_routing={str(args.routing == 'forced_balanced').lower()}")
    cfg, error = compose_config(common)
    if cfg is None:
        print(f"moe-tune-bench: error: {error}", file=sys.stderr)
        return 2
    now = datetime.datetime.now()
    num_gpus = nproc if _cuda() else 0
    out = args.out or os.path.join("benchmarks", "results", f"{now:%Y-%m-%d}-{hardware_label(num_gpus)}")
    plans, skipped = build_plans(args, common)
    problem = plans_problem(plans, skipped, cfg, nproc) or variant_problem(plans, common)
    if problem:
        print(f"moe-tune-bench: error: {problem}", file=sys.stderr)
        return 2
    for s in skipped:
        print(f"[bench] {s['variant']}: not run, {s['reason']}", flush=True)
    if args.dry_run:
        return _print_plans(plans, skipped, out, nproc)
    if not _has_matplotlib():  # before any row runs: the chart is drawn after the last one
        print("moe-tune-bench: error: the PNG chart needs matplotlib: pip install 'moe_tune[bench]'", file=sys.stderr)
        return 2
    result = new_result(args, argv, cfg, common, nproc, num_gpus, now)
    result["skipped"] = skipped
    os.makedirs(out, exist_ok=True)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    json_path, runs = os.path.join(out, f"bench-{stamp}.json"), os.path.join(out, "runs", stamp)
    for i, plan in enumerate(plans, 1):
        row = run_plan(plan, f"{i}/{len(plans)}", common, runs, nproc, args)
        result["rows"].append(row.as_dict())
        result["reference_variant"] = finish_rows(result["rows"], result["peak_tflops_per_gpu"], args.reference)
        result["flops_per_token"] = result["flops_per_token"] or row.flops_per_token
        write_json(json_path, result)  # after every row: a killed benchmark keeps what it measured
    result["complete"] = True
    write_json(json_path, result)
    md, png = write_report(result, json_path)
    print(f"[bench] wrote {json_path}, {md}, {png}", flush=True)
    return 0


def new_result(args, argv: list[str], cfg, common: list[str], nproc: int, num_gpus: int, now) -> dict:
    """The result file's header: where, what, with which code; rows are appended as they finish."""
    import torch

    from moe_tune.bench.report import gpu_name, peak_tflops
    from moe_tune.env import versions
    from moe_tune.run_record import git_commit, hardware_name

    hardware = f"{num_gpus} x {gpu_name()}" if num_gpus else hardware_name(nproc, torch.device("cpu"))
    peak = args.peak_tflops or peak_tflops(hardware)
    return {
        "hardware": hardware,
        "num_gpus": num_gpus,
        "world_size": nproc,
        "commit": git_commit(),
        "dirty": _dirty(),
        "date": now.isoformat(timespec="seconds"),
        "versions": {**versions(), **_optional_versions()},
        "workload": workload(cfg, nproc),
        "flops_per_token": None,
        "peak_tflops_per_gpu": peak,
        "peak_source": (PEAK_SOURCE if args.peak_tflops is None else "given with --peak-tflops") if peak else None,
        "reference_variant": None,
        "common_overrides": common,
        "command": "moe-tune-bench " + shlex.join(argv),
        "complete": False,
        "rows": [],
        "skipped": [],
    }


def run_plan(plan: Plan, progress: str, common: list[str], runs: str, nproc: int, args) -> Row:
    """Compose the row's config (a bad override is an error row, not run), then run it in its own directory."""
    variant_cfg, error = compose_config(plan.overrides)
    row = Row(plan.name, plan.kind, config=row_config(variant_cfg, plan.kind, experts_arg(plan)))
    row.config["overrides"] = plan.overrides[len(common) :] if plan.kind == "moe_tune" else []
    if "--no-fsdp" in plan.args:
        row.config["fsdp"] = "none"
    if error is not None:
        row.status = f"error: {error}"
        print(f"[bench] {progress} {plan.name}: not run, {row.status}", flush=True)
        return row
    env_extra = {"PYTHONPATH": args.peer_pythonpath} if plan.kind == "peer" and args.peer_pythonpath else {}
    print(f"[bench] {progress} {plan.name}: running", flush=True)
    t0 = time.perf_counter()
    run_dir = os.path.join(runs, re.sub(r"[^\w.-]+", "_", plan.name))  # no '=' or ',' in a Hydra value
    run_row(row, plan.module, plan.args, plan.overrides, run_dir, nproc, args.timeout_s, env_extra)
    print(f"[bench] {progress} {plan.name}: {row.one_line()} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return row


def _print_plans(plans: list[Plan], skipped: list[dict], out: str, nproc: int) -> int:
    from moe_tune.bench.runner import launch_command

    for plan in plans:
        args = [*plan.args, *plan.overrides, f"output_dir={out}/runs/<stamp>/{plan.name}"]
        print(f"{plan.name} ({plan.kind}): {shlex.join(['python', *launch_command(plan.module, args, nproc)[1:]])}")
    for s in skipped:
        print(f"{s['variant']} ({s['kind']}): skipped, {s['reason']}")
    return 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _optional_versions() -> dict:
    """The versions of the optional stacks that are installed (NeMo AutoModel, TRL and its datasets)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("nemo_automodel", "trl", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:  # not installed: nothing to report
            pass
    return found


def _dirty() -> bool | None:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


__all__ = ["main", "parse_variants", "split_overrides"]
