"""benchmarks/precision_table.py: joining bench files of one workload, the bounds, the summary across seeds."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "precision_table.py"
_spec = importlib.util.spec_from_file_location("precision_table", _PATH)
pt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pt)


def _row(variant, final, kernels="torch", fp8="none", status="ok"):
    losses = [2.0] * 95 + [final] * 5
    return {
        "variant": variant,
        "status": status,
        "config": {"precision": "bf16_fp32_master", "kernels": kernels, "fp8": fp8},
        "losses": losses,
        "wall_s": 40.0,
        "tokens_per_s_per_gpu": 1000.0,
        "peak_mem_gib": 10.0,
    }


def _bench(rows, seed=0, overrides=("train.lr=3e-5",), commit="abc"):
    return {
        "workload": {
            "model": "m",
            "num_layers": 2,
            "seq_len": 4096,
            "micro_batch_size": 1,
            "steps": 100,
            "lr": 3e-5,
            "routing": "real",
            "seed": seed,
        },
        "common_overrides": list(overrides),
        "commit": commit,
        "rows": rows,
    }


def test_merge_joins_rows_and_checks_reruns_bit_for_bit():
    a = _bench([_row("bf16_torch", 1.0), _row("te", 1.004, "te")])
    b = _bench([_row("bf16_torch", 1.0), _row("te_fp8_current", 1.03, "te", "current")], commit="def")
    b["common_overrides"].append("train.seed=0")  # explicit default seed: the same workload
    merged, reruns = pt.merge([a, b])
    assert [r["variant"] for r in merged["rows"]] == ["bf16_torch", "te", "te_fp8_current"]
    assert reruns == {"bf16_torch": True} and merged["commit"] == "abc, def"
    c = _bench([_row("bf16_torch", 1.001)])
    assert pt.merge([a, c])[1] == {"bf16_torch": False}
    failed_first = _bench([_row("te", 0.0, "te", status="error: timeout")])
    assert pt.merge([failed_first, a])[0]["rows"][0]["losses"][-1] == 1.004  # the run that finished


def test_merge_refuses_files_of_another_workload(capsys):
    a = _bench([_row("bf16_torch", 1.0)])
    with pytest.raises(SystemExit) as e:
        pt.merge([a, _bench([_row("te", 1.0, "te")], overrides=("train.lr=1e-4",))])
    assert e.value.code == 2 and "differ in common_overrides" in capsys.readouterr().out


def test_bounds_against_the_reference():
    rows = pt.summarize(
        _bench(
            [
                _row("bf16_torch", 1.0),
                _row("te", 1.012, "te"),
                _row("te_fp8_current", 1.019, "te", "current"),
                _row("te_fp8_current_fwd_only", 0.97, "te", "current"),
            ]
        )
    )
    by = {r["variant"]: r for r in rows}
    assert by["te"]["final_diff"] == pytest.approx(0.012) and by["te"]["within_bound_final"] is False
    assert by["te_fp8_current"]["within_bound_final"] is True and by["te_fp8_current"]["kernels"] == "te+fp8:current"
    assert by["te_fp8_current_fwd_only"]["within_bound_final"] is False  # 3% below counts as well as above
    with pytest.raises(SystemExit, match="reference row 'bf16_torch' is missing"):
        pt.summarize(_bench([_row("te", 1.0, "te")]))


def test_summary_across_seeds_counts_held_bounds_and_refuses_other_settings(capsys):
    sources = {
        "q": _bench([], seed=0),
        "q/seed1": _bench([], seed=1, overrides=("train.lr=3e-5", "train.seed=1")),
    }
    ref, fp8 = _row("bf16_torch", 1.0), "te_fp8_current"
    tables = {
        "q": pt.summarize(_bench([ref, _row(fp8, 1.01, "te", "current")])),
        "q/seed1": pt.summarize(_bench([ref, _row(fp8, 1.03, "te", "current")])),
    }
    text = "\n".join(pt.repeats_summary(tables, sources))
    assert "| te_fp8_current | 2.00% | +1.00% | +3.00% | 2.00% | 1 of 2 |" in text
    sources["q/seed1"]["common_overrides"].append("train.steps=50")
    with pytest.raises(SystemExit) as e:
        pt.repeats_summary(tables, sources)
    assert e.value.code == 2 and "is not q with another seed" in capsys.readouterr().out


def test_main_writes_json_markdown_and_chart(tmp_path):
    import json

    files = {}
    for name, seed, fp8_final in (("a", 0, 1.01), ("b", 1, 1.03)):
        rows = [
            _row("bf16_torch", 1.0),
            _row("torch_unfused_loss", 1.002),
            _row("te_fp8_current", fp8_final, "te", "current"),
        ]
        overrides = ("train.lr=3e-5", f"train.seed={seed}")
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({**_bench(rows, seed, overrides), "hardware": "1 x H200", "num_gpus": 1}))
    out = tmp_path / "precision"
    assert pt.main([str(out), f"w={files['a']}", f"w/seed1={files['b']}"]) == 0
    md = (tmp_path / "precision.md").read_text()
    assert "| te_fp8_current | 2.00% | +1.00% | +3.00% | 2.00% | 1 of 2 |" in md
    assert json.loads((tmp_path / "precision.json").read_text())
    assert (tmp_path / "precision.png").stat().st_size > 10_000


def test_rows_table_prints_every_row_of_every_run(tmp_path, capsys):
    """benchmarks/rows_table.py, the benchmark scripts' last output: one line per row, runs found recursively."""
    import json

    spec = importlib.util.spec_from_file_location("rows_table", _PATH.parent / "rows_table.py")
    rows_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows_table)
    workload = {"micro_batch_size": 4, "activation_checkpointing": "none"}
    for run, variant, tps in (("a", "hf_grouped_mm", 42406.0), ("b/mb4", "moe_tune_compile", 60706.0)):
        (tmp_path / run).mkdir(parents=True)
        row = {"variant": variant, "status": "ok", "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 1.0}
        result = {"commit": "bef7ddf0", "workload": workload, "rows": [row]}
        (tmp_path / run / "bench-1.json").write_text(json.dumps(result))
    assert rows_table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "42,406" in lines[1] and "mb4" in lines[2] and "60,706" in lines[2]
