"""moe-tune-plan against every measured H200 row: predicted vs measured peak memory and tokens/s per GPU.

The rows: benchmarks/plan_rows.json, every moe_tune training row committed under benchmarks/results (and in git
history) with its overrides and measurements. A configuration measured at several commits is taken at its
latest (the engine's memory moved as it changed; the older figures describe code that is gone), the median of
that commit's rows. Rows that need what the planner does not model are listed apart with the reason: kernels=te
(TransformerEngine's layers, not measured on the CPU), amp_bf16, data the planner cannot see the fill of.

    python benchmarks/plan_calibration.py --out benchmarks/results/<dir>/plan_calibration   # table, JSON
    python benchmarks/plan_calibration.py --fit     # also fit the constants (prints them; the code keeps them)

Each configuration is planned once (census and activations), so a fit re-evaluates only the arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

# The calibration: the latest measurement of each configuration the engine has been measured in (one H200: 8 and 24
# layers, micro-batch 1-4, sequences 4k-262k with and without full checkpointing, packed real data, fp32 master
# weights, LoRA on the full 48 layers; 2 x H200: EP=2 with each comm backend, micro-batch 1 and 4, long sequences).
# Every other row is an earlier measurement of code that has since changed: shown as history, not counted.
CURRENT = (
    "1204-1x-house-7202622-old-1",
    "md-d092670-1x-mb1-compile",
    "1203-1x-trl-5783a61-1923-moe-tune-mb1",
    "1202-1x-3stacks-55a51ef-l24-0156-moe-tune-mb2",
    "1202-1x-3stacks-55a51ef-l24-0156-moe-tune-mb3",
    "1201-1x-sr-24-layers-97d9432-l24-2002-moe-tune-mb1",
    "1201-1x-sr-24-layers-97d9432-l24-2002-moe-tune-mb2-ac-full",
    "md-d092670-1x-seq32768",
    "md-d092670-1x-seq65536-acfull",
    "md-d092670-1x-seq131072-acfull",
    "md-d092670-1x-seq262144-acfull",
    "1202-1x-packing-b59c456-2138-best-fit",
    "1202-1x-losses-e427ee6-losses-0200-fused",
    "1202-1x-losses-e427ee6-losses-0200-fused-chunk1024",
    "1202-1x-losses-e427ee6-losses-0200-unfused",
    "1201-1x-fp8-experts-0609-fp8",
    "1201-1x-sr-losses-efbc387-small-seed0-2255-bf16-sr",
    "1201-1x-sr-losses-efbc387-small-seed0-2255-bf16-torch",
    "1201-1x-sr-losses-efbc387-small-seed0-2255-torch-unfused-loss",
    "1201-1x-lora-ac-none-0347-lora",
    "1201-1x-lora-ac-none-0347-lora-compile",
    "1201-1x-lora-ac-full-0349-lora",
    "1201-1x-lora-ac-full-side-by-side-0407-lora-compile",
    "1201-2x-issue14-f58300b-log-mb1-moe-tune-compile",
    "1201-2x-issue14-f58300b-log-mb4-moe-tune-compile",
    "1201-2x-issue14-f58300b-log-mb1-overlap-compile",
    "1201-2x-issue14-f58300b-log-mb4-overlap-compile",
    "1201-2x-issue14-f58300b-log-mb4-deepep-compile",
    "1201-2x-issue14-f58300b-mb1-rest-1026-deepep-compile",
    "1201-2x-issue14-f58300b-fp32-master-mb1-1028-fp32-master-compile",
    "md-d4c6fd2-2x-mb4-deepep-eager",
    "md-d4c6fd2-2x-seq32768-a2a",
    "md-d4c6fd2-2x-seq65536-acfull-a2a",
)
ROWS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_rows.json")
# Overrides that change neither memory nor speed (the data's content, the run's length, logging).
IGNORED = (
    "data",
    "+data",
    "train.steps",
    "train.warmup_steps_excluded",
    "train.lr",
    "train.seed",
    "train.log_every",
    "train.profile",
    "optim.compiled",
    "checkpoint",
    "logger",
)


def assumed(entry: dict) -> list[str]:
    """Overrides a row's source leaves out: a Markdown figure that does not say whether it was compiled is taken as
    compiled (the engine's recommended setting in those sessions), flagged in the table."""
    if entry["workload"].get("compile") is None and not any(
        o.startswith("kernels.compile") for o in entry["overrides"]
    ):
        return ["kernels.compile=true"]
    return []


def normalized(overrides: list[str]) -> list[str]:
    """The overrides that matter, the last value of a repeated key (as Hydra resolves it)."""
    kept: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        if key.split(".")[0] in IGNORED or key.startswith(IGNORED) or key.startswith("data"):
            continue
        kept[key] = o
    return list(kept.values())


# What decides memory and speed in a row's workload (the data's content, seeds, lengths of runs do not).
WORKLOAD_KEYS = (
    "model",
    "num_layers",
    "seq_len",
    "micro_batch_size",
    "global_batch_size",
    "activation_checkpointing",
    "peft",
    "compile",
    "comm",
    "ep",
    "precision",
    "routing",
)
EXTRA_KEYS = (
    "kernels",
    "experts",
    "fp8",
    "fp8_backward",
    "fused_loss",
    "loss_chunk_size",
    "compile_dynamic",
    "comm_overlap",
    "comm_dedup",
    "stochastic_rounding",
    "dp_replicate",
    "reshard_after_forward",
)


def configuration(workload: dict) -> tuple:
    extra = workload.get("extra") or {}
    return tuple(workload.get(k) for k in WORKLOAD_KEYS) + tuple(extra.get(k) for k in EXTRA_KEYS)


def not_modelled(overrides: list[str]) -> str | None:
    text = " ".join(overrides)
    if "kernels=te" in text:
        return "kernels=te: TransformerEngine layers (their saved activations are not measured on the CPU)"
    if "amp_bf16" in text:
        return "train.precision=amp_bf16: autocast's cached casts are not modelled"
    if "grouped_mm_fp8" in text:
        return "kernels.experts=grouped_mm_fp8: its eager quantization's time is not modelled (issue 36's work)"
    if "kernels.experts=loop" in text:
        return "kernels.experts=loop: the reference loop's per-expert temporaries are not modelled"
    return None


def calibration_set(rows: list[dict]) -> list[dict]:
    """One entry per configuration: its latest commit's rows, medians. A ``CURRENT`` row is its own entry (with
    the rows of its commit and configuration)."""
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] not in ("ok", "oom"):
            continue
        key = (r["num_gpus"], configuration(r["workload"]))
        if r["id"] in CURRENT:
            key = (r["num_gpus"], r["id"])
        by_key.setdefault(key, []).append(r)
    out = []
    for (gpus, _), group in by_key.items():
        dated = [r for r in group if r.get("date")]
        latest_date = max((r["date"][:10] for r in dated), default=None)
        latest = [r for r in group if (r.get("date") or "")[:10] == latest_date] or group
        ok = [r for r in latest if r["status"] == "ok"]

        def median(field: str, rs=ok) -> float | None:
            values = [r["measured"].get(field) for r in rs if r["measured"].get(field)]
            return statistics.median(values) if values else None

        if not median("tokens_per_s_per_gpu"):  # the latest commit quoted no figure: the latest that did
            quoted = [r for r in group if r["status"] == "ok" and r["measured"].get("tokens_per_s_per_gpu")]
            last = max((r.get("date") or "" for r in quoted), default=None)
            speed_rows = [r for r in quoted if (r.get("date") or "") == last]
        else:
            speed_rows = ok
        first = next((r for r in latest if r["id"] in CURRENT), latest[0])
        out.append(
            {
                "id": first["id"],
                "gpus": gpus,
                "overrides": normalized(first["overrides"]),
                "status": "ok" if ok else "oom",
                "commit": first.get("commit"),
                "date": latest_date,
                "rows": len(latest),
                "routing": first["workload"].get("routing", "real"),
                "measured_peak_gib": median("peak_mem_gib"),
                "measured_reserved_gib": median("peak_reserved_gib"),
                "measured_tokens_per_s_per_gpu": median("tokens_per_s_per_gpu", speed_rows),
                "current": first["id"] in CURRENT,
                "workload": first["workload"],
            }
        )
    return sorted(out, key=lambda e: (e["gpus"], e["id"]))


def predict_all(entries: list[dict]) -> list[dict]:
    from moe_tune.config import ConfigError
    from moe_tune.config.overrides import check, to_config
    from moe_tune.plan import plan

    for e in entries:
        e["skipped"] = not_modelled(e["overrides"])
        if e["skipped"]:
            continue
        t = time.perf_counter()
        try:
            e["assumed"] = assumed(e)
            cfg = to_config(check(e["overrides"] + e["assumed"]))
            p = plan(cfg, e["gpus"], routing="balanced" if e["routing"] == "balanced" else "real")
        except ConfigError as err:  # a setting refused since it was measured
            e["skipped"] = f"refused today: {err}"
            continue
        e["plan"] = p
        e["plan_s"] = time.perf_counter() - t
    return entries


def score(entries: list[dict], calibration=None, rates=None) -> list[dict]:
    """Predicted figures for every planned entry with these constants (the defaults: the code's)."""
    from moe_tune.plan import memory, speed

    calibration = calibration or memory.CALIBRATION
    rates = rates or speed.H200
    for e in entries:
        p = e.get("plan")
        if p is None:
            continue
        cfg = p.config
        balanced = e["routing"] == "balanced" or p.census.dims.ep == 1
        imbalance = 1.0 if balanced else calibration.real_routing_imbalance
        acts = _acts(p)
        m = memory.predict(p.census, acts, cfg, calibration, "balanced" if balanced else "real")
        s = speed.step_seconds(p.census, acts, cfg, rates, speed.LINKS, imbalance)
        e["predicted_peak_gib"] = m.peak / memory.GIB
        e["predicted_reserved_gib"] = m.reserved / memory.GIB
        e["predicted_tokens_per_s_per_gpu"] = s["tokens_per_s_per_gpu"]
        e["fits_predicted"] = m.reserved / memory.GIB <= p.gpu_mem_gib * (1 - p.headroom)
        if e["measured_peak_gib"]:
            e["peak_error"] = e["predicted_peak_gib"] / e["measured_peak_gib"] - 1
        if e["measured_tokens_per_s_per_gpu"]:
            e["speed_error"] = e["predicted_tokens_per_s_per_gpu"] / e["measured_tokens_per_s_per_gpu"] - 1
    return entries


def _acts(p):
    from moe_tune.plan import _activation_options
    from moe_tune.plan.activations import measured

    return measured(p.hf_config, _activation_options(p.config, p.census.dims))


def fit(entries: list[dict]) -> tuple:
    """Coordinate search over the constants, minimising the mean squared relative error over the current rows
    (memory constants against peak memory, rates against tokens/s); the worst errors are reported, not minimised
    (a single odd row would otherwise set every constant)."""
    from moe_tune.plan import memory, speed

    calib, rates = memory.CALIBRATION, speed.H200
    grids = {
        "compiled_activations": [0.6 + 0.02 * i for i in range(21)],
        "backward_working": [0.1 * i for i in range(21)],
        "real_routing_imbalance": [1.0 + 0.05 * i for i in range(11)],
        "ep_dispatch_copies": [0.5 * i for i in range(9)],
        "fixed_gib": [0.1 * i for i in range(11)],
    }
    for _ in range(3):
        for name, grid in grids.items():
            best = min(
                grid, key=lambda v: loss_after(entries, dataclasses.replace(calib, **{name: v}), rates, "peak_error")
            )
            calib = dataclasses.replace(calib, **{name: best})
    rate_grids = {
        "dense_tflops": [400 + 20 * i for i in range(20)],
        "experts_tflops": [400 + 20 * i for i in range(20)],
        "half_rate_rows": [16 * i for i in range(1, 16)],
        "attention_tflops": [250 + 25 * i for i in range(16)],
        "memory_passes_eager": [2 + i for i in range(16)],
        "memory_passes_compiled": [1 + 0.5 * i for i in range(16)],
        "host_ms_per_layer_eager": [1.0 * i for i in range(21)],
        "host_ms_per_layer_compiled": [0.1 * i for i in range(16)],
        "fsdp_ns_per_byte": [0.0008 * i for i in range(16)],
        "ep_ms_per_layer": [0.25 * i for i in range(16)],
    }
    for _ in range(3):
        for name, grid in rate_grids.items():
            best = min(
                grid, key=lambda v: loss_after(entries, calib, dataclasses.replace(rates, **{name: v}), "speed_error")
            )
            rates = dataclasses.replace(rates, **{name: best})
    score(entries, calib, rates)
    return calib, rates


def loss_after(entries, calib, rates, key) -> float:
    score(entries, calib, rates)
    errs = [e[key] ** 2 for e in entries if key in e and e["current"]]
    return sum(errs) / max(len(errs), 1)


def markdown(entries: list[dict]) -> str:
    lines = [
        "| row | GPUs | layers | seq | mb | AC | LoRA | compile | comm | ep | precision | measured GiB | predicted GiB | "
        "error | measured tokens/s/GPU | predicted | error |",
        "|---|---:|---:|---:|---:|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        w = e["workload"]
        flag = " (compile assumed)" if e.get("assumed") else ""
        head = (
            f"| {e['id']}{flag} | {e['gpus']} | {w.get('num_layers')} | {w.get('seq_len')} | {w.get('micro_batch_size')} | "
            f"{w.get('activation_checkpointing')} | {w.get('peft') or ''} | {'yes' if w.get('compile') else 'no'} | "
            f"{w.get('comm')} | {w.get('ep')} | {w.get('precision')} |"
        )
        if e.get("skipped"):
            lines.append(
                head
                + f" {_f(e['measured_peak_gib'])} | not modelled | | {_f(e['measured_tokens_per_s_per_gpu'], ',.0f')} | | |"
            )
            continue
        if e["status"] == "oom":
            verdict = "predicted not to fit" if not e["fits_predicted"] else "predicted to FIT"
            lines.append(
                head
                + f" oom | {e['predicted_peak_gib']:.1f} ({verdict}) | | | {e['predicted_tokens_per_s_per_gpu']:,.0f} | |"
            )
            continue
        lines.append(
            head + f" {_f(e['measured_peak_gib'])} | {e['predicted_peak_gib']:.1f} | {_pct(e.get('peak_error'))} | "
            f"{_f(e['measured_tokens_per_s_per_gpu'], ',.0f')} | {e['predicted_tokens_per_s_per_gpu']:,.0f} | "
            f"{_pct(e.get('speed_error'))} |"
        )
    return "\n".join(lines)


def _f(v, spec=".1f") -> str:
    return "" if v is None else format(v, spec)


def _pct(v) -> str:
    return "" if v is None else f"{v:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for plan_calibration.{json,md}")
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--only", default=None, help="a substring of the row ids to keep")
    args = ap.parse_args()
    entries = calibration_set(json.load(open(ROWS)))
    if args.only:
        entries = [e for e in entries if args.only in e["id"]]
    predict_all(entries)
    score(entries)
    fitted = None
    if args.fit:
        fitted = fit(entries)
        print("fitted:", fitted, file=sys.stderr)
    planned = [e for e in entries if "plan" in e and e["current"]]
    peak_errs = [abs(e["peak_error"]) for e in planned if "peak_error" in e]
    speed_errs = [abs(e["speed_error"]) for e in planned if "speed_error" in e]
    current = [e for e in entries if e["current"]]
    text = (
        "## The calibration: the latest measurement of each configuration\n\n"
        + markdown(current)
        + "\n\n## History: earlier measurements (code since changed; not counted)\n\n"
        + markdown([e for e in entries if not e["current"]])
    )
    summary = (
        f"{len(planned)} current configurations planned ({len(current) - len(planned)} not modelled); peak memory within "
        f"{max(peak_errs):.1%} (median {statistics.median(peak_errs):.1%}) of {len(peak_errs)} measured; tokens/s "
        f"within {max(speed_errs):.1%} (median {statistics.median(speed_errs):.1%}) of {len(speed_errs)}; "
        f"slowest plan {max(e['plan_s'] for e in planned):.1f} s"
    )
    print(text + "\n\n" + summary)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(os.path.join(args.out, "plan_calibration.md"), "w") as f:
            f.write(f"moe-tune-plan at {commit} against the measured rows ({ROWS.rsplit('/', 1)[-1]}).\n\n")
            f.write(text + "\n\n" + summary + "\n")
        keep = (
            "id",
            "gpus",
            "overrides",
            "assumed",
            "status",
            "commit",
            "date",
            "rows",
            "routing",
            "current",
            "skipped",
        )
        figures = sorted(
            {k for e in entries for k in e if k.startswith(("measured_", "predicted_")) or k.endswith("_error")}
        )
        with open(os.path.join(args.out, "plan_calibration.json"), "w") as f:
            json.dump(
                {
                    "commit": commit,
                    "summary": summary,
                    "fitted": repr(fitted) if fitted else None,
                    "rows": [{k: e.get(k) for k in (*keep, *figures)} for e in entries],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
