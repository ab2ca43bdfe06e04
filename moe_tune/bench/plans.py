"""What one ``moe-tune-bench`` run is made of: its rows (``Plan``: baselines, moe_tune variants, the peer), parsed
from the command line and checked as a whole before any row runs."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from moe_tune.bench.runner import split_overrides

# Plain Transformers rows: experts_implementation, and "_nofsdp" for the model without FSDP (one process only);
# "trl": TRL's SFTTrainer (moe_tune.bench.trl_baseline; one process, records from data.path); "bnb4": peft=lora on
# bitsandbytes 4-bit linears (one process).
BASELINES = ("grouped_mm", "eager", "grouped_mm_nofsdp", "eager_nofsdp", "trl", "bnb4")
TRL_INSTALL = "pip install 'moe_tune[trl]'"
BNB_INSTALL = "pip install bitsandbytes (0.48 or later)"
# The TRL row's train.precision values (one process: parameters in their compute dtype, or fp32 under autocast)
TRL_PRECISIONS = ("bf16", "amp_bf16", "fp32")
TRL_ATTENTION = ("auto", "flex_attention", "sdpa", "eager")  # --trl-attn (auto: moe_tune.bench.trl_baseline)


@dataclass
class Plan:
    name: str
    kind: str  # baseline | moe_tune | peer
    module: str
    args: list[str]
    overrides: list[str] = field(default_factory=list)


def parse_variants(spec: str | None) -> list[tuple[str, list[str]]]:
    """``'a2a:comm=all_to_all,parallel.ep=2;comm=deepep,parallel.ep=2'`` -> [(name, overrides)], names
    defaulting to the overrides' leaf keys and values (``comm=deepep,ep=2``), made unique. ``'none'``: no
    moe_tune row (a run of baselines or the peer only)."""
    out: list[tuple[str, list[str]]] = []
    if (spec or "").strip() == "none":
        return out
    for part in (spec or "").split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, rest = part.partition(":")
        if not sep or "=" in name:
            name, rest = "", part
        overrides = split_overrides(rest)
        name = name.strip() or ",".join(
            f"{o.partition('=')[0].rsplit('.', 1)[-1]}={o.partition('=')[2]}" for o in overrides
        )
        out.append((name or "moe_tune", overrides))
    if not out:
        out = [("moe_tune", [])]
    seen: dict[str, int] = {}
    unique = []
    for name, overrides in out:
        seen[name] = seen.get(name, 0) + 1
        unique.append((name if seen[name] == 1 else f"{name}-{seen[name]}", overrides))
    return unique


def baseline_names(spec: str) -> list[str]:
    return [] if spec.strip() == "none" else [b.strip() for b in spec.split(",") if b.strip()]


def args_problem(args) -> str | None:
    """The line for a flag no row can run with (checked before anything runs), or None."""
    unknown = [b for b in baseline_names(args.baselines) if b not in BASELINES]
    if unknown:
        return f"--baselines {unknown[0]!r} is not one of {', '.join(BASELINES)}, none"
    bounds = [
        ("--nproc", args.nproc, 1, "give the ranks per row, >= 1"),
        ("--timeout-s", args.timeout_s, 1e-9, "give each row's time limit in seconds, > 0"),
        ("--peer-ep", args.peer_ep, 1, "give NeMo AutoModel's EP size, >= 1"),
        ("--peak-tflops", args.peak_tflops, 1e-9, "give the per-GPU peak TFLOP/s, > 0"),
    ]
    return next(
        (f"{flag} {value:g}: {fix}" for flag, value, low, fix in bounds if value is not None and value < low), None
    )


def build_plans(args, common: list[str]) -> tuple[list[Plan], list[dict]]:
    plans, skipped = [], []
    baselines = baseline_names(args.baselines)
    for b in baselines:
        if b not in BASELINES:
            raise SystemExit(f"moe-tune-bench: error: {args_problem(args)}")
        if b == "trl":
            if importlib.util.find_spec("trl") is None:
                reason = f"trl is not installed: {TRL_INSTALL}"
                skipped.append({"variant": "trl", "kind": "baseline", "reason": reason})
            else:
                plans.append(Plan("trl", "baseline", "moe_tune.bench.trl_baseline", ["--attn", args.trl_attn], common))
            continue
        if b == "bnb4":  # Transformers + PEFT on bitsandbytes 4-bit linears: QLoRA as its users run it
            if importlib.util.find_spec("bitsandbytes") is None:
                reason = f"bitsandbytes is not installed: {BNB_INSTALL}"
                skipped.append({"variant": "hf_bnb4", "kind": "baseline", "reason": reason})
            else:
                plans.append(Plan("hf_bnb4", "baseline", "moe_tune.bench.baseline", ["--bnb4"], common))
            continue
        flags = ["--experts", b.removesuffix("_nofsdp")] + (["--no-fsdp"] if b.endswith("_nofsdp") else [])
        plans.append(Plan(f"hf_{b}", "baseline", "moe_tune.bench.baseline", flags, common))
    for name, overrides in parse_variants(args.variants):
        plans.append(Plan(name, "moe_tune", "moe_tune", [], common + overrides))
    if args.peer == "automodel":
        if importlib.util.find_spec("nemo_automodel") is None and not args.peer_pythonpath:
            skipped.append(
                {"variant": "nemo_automodel", "kind": "peer", "reason": "nemo_automodel is not importable here "
                 "(install it into a directory of its own, e.g. pip install --target DIR nemo_automodel==0.7.0, since it brings "
                 "its own transformers, and give --peer-pythonpath DIR)"}
            )  # fmt: skip
        else:
            peer_args = ["--dispatcher", args.peer_dispatcher, "--backend", args.peer_backend]
            peer_args += ["--ep", str(args.peer_ep)] if args.peer_ep else []
            plans.append(
                Plan(f"nemo_automodel_{args.peer_dispatcher}", "peer", "moe_tune.bench.peer", peer_args, common)
            )
    return plans, skipped


def plans_problem(plans: list[Plan], skipped: list[dict], cfg, nproc: int) -> str | None:
    """What makes the asked rows unrunnable as a whole, before any runs: nothing to run, a plain-model baseline
    (``_nofsdp``) where it cannot run, a PEFT baseline of a quantized base."""
    if not plans and not skipped:
        return "no rows to run (--baselines none and --variants none, no --peer); ask for at least one"
    nofsdp = [p.name for p in plans if "--no-fsdp" in p.args]
    fp32_params = cfg.train.precision == "bf16_fp32_master" and cfg.peft.name != "lora"  # LoRA's base is bf16
    if nofsdp and (nproc > 1 or fp32_params):
        return (
            f"{', '.join(nofsdp)}: the plain Transformers model without FSDP2 runs on one process (got --nproc "
            f"{nproc}) with parameters in their compute dtype, train.precision bf16, fp32 or amp_bf16 (got "
            f"{cfg.train.precision}); use --baselines grouped_mm or set train.precision=bf16"
        )
    bnb4 = [p.name for p in plans if "--bnb4" in p.args]
    if bnb4 and (cfg.peft.name != "lora" or nproc > 1):
        return f"hf_bnb4: QLoRA through bitsandbytes runs peft=lora on one process (got peft={cfg.peft.name}, --nproc {nproc})"
    baselines = [p.name for p in plans if p.module == "moe_tune.bench.baseline" and p.name not in bnb4]
    if baselines and quantized_base_problem(cfg):
        return f"{', '.join(baselines)}: {quantized_base_problem(cfg)}"
    if any(p.module == "moe_tune.bench.trl_baseline" for p in plans):
        problem = workload_problem(cfg, nproc)
        return f"trl: {problem}" if problem else None
    return None


def quantized_base_problem(cfg) -> str | None:
    """A quantized LoRA base has no Transformers + PEFT row (it would train a bf16 base under the quantized row's
    name); checked by moe-tune-bench before any row and by the row itself (``peft_baseline.lora_config``)."""
    if cfg.peft.name != "lora" or cfg.peft.quantize_base == "none":
        return None
    base = cfg.peft.quantize_base
    return (
        f"peft.quantize_base={base} has no Transformers + PEFT baseline row: bitsandbytes quantizes nn.Linear layers "
        f"only, not transformers' fused expert tensors; give it in --variants instead of the overrides, e.g. "
        f"--variants 'qlora_{base}:peft=lora,peft.quantize_base={base}' (name:key=value,key=value; rows separated "
        "by ';'), beside --baselines bnb4 (Transformers + PEFT on bitsandbytes 4-bit) or none"
    )


def workload_problem(cfg, world: int) -> str | None:
    """What in the workload the TRL row cannot run (None: nothing), checked by moe-tune-bench before any row runs
    and by the row itself."""
    if world > 1:
        return f"the TRL row runs as one process on one GPU (got {world} processes); run moe-tune-bench with --nproc 1"
    if cfg.train.precision not in TRL_PRECISIONS:
        return (
            f"train.precision={cfg.train.precision}: the TRL row (one process, no FSDP) runs {', '.join(TRL_PRECISIONS)} "
            "(bf16: bf16 parameters; amp_bf16: fp32 parameters under bf16 autocast); set train.precision=bf16"
        )
    if cfg.data.path is None:
        return (
            f"the TRL row trains on records and data={cfg.data.name} has none it can read; set data.path=<jsonl> "
            "(e.g. from benchmarks/chat_lognormal.py)"
        )
    if cfg.peft.name != "none" or cfg.parallel.activation_checkpointing == "selective":
        return (
            f"the TRL row trains every weight with activation checkpointing none or full (got peft={cfg.peft.name}, "
            f"parallel.activation_checkpointing={cfg.parallel.activation_checkpointing}); benchmark without them"
        )
    return None


def experts_arg(plan: Plan) -> str | None:
    return plan.args[plan.args.index("--experts") + 1] if "--experts" in plan.args else None
