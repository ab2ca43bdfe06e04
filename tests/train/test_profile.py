"""train.profile=true: the step summary (GPU busy, exposed communication) from device-kernel intervals."""

from __future__ import annotations

import json

import pytest

from moe_tune.train.profile import timeline_summary


def test_busy_and_exposed_communication_from_intervals():
    # Two steps over 0..100 ms (times in us). Compute: 0-30 and 50-60 on one stream, 20-40 on another (union
    # 0-40, 50-60). Communication: 35-55 (hidden 35-40 and 50-55, exposed 40-50) and 90-95 (exposed).
    ms = 1000
    kernels = [
        ("ampere_bf16_gemm", 0, 30 * ms),
        ("flash_fwd", 20 * ms, 40 * ms),
        ("vectorized_elementwise", 50 * ms, 60 * ms),
        ("ncclDevKernel_SendRecv", 35 * ms, 55 * ms),
        ("ncclDevKernel_AllGather", 90 * ms, 95 * ms),
    ]
    s = timeline_summary(kernels, wall=(0, 100 * ms), steps=2, host_syncs=3)
    assert s["gpu_busy_fraction"] == pytest.approx(0.65)  # any kernel: 0-60 and 90-95
    assert s["compute_ms_per_step"] == pytest.approx(50 / 2)
    assert s["communication_ms_per_step"] == pytest.approx(25 / 2)
    assert s["exposed_communication_ms_per_step"] == pytest.approx(15 / 2)
    assert s["wall_ms_per_step"] == pytest.approx(50)
    assert s["host_syncs_per_step"] == 1.5


def test_fully_hidden_communication_is_not_exposed():
    kernels = [("gemm", 0, 100), ("ncclKernel_AllToAll", 10, 90), ("deep_ep::combine", 20, 30)]
    s = timeline_summary(kernels, wall=(0, 200), steps=1, host_syncs=0)
    assert s["exposed_communication_ms_per_step"] == 0
    assert s["gpu_busy_fraction"] == pytest.approx(0.5)


def test_profiled_run_writes_its_tables(tmp_path, make_trainer):
    """On CPU the trace has no device kernels: the table is written and the summary is null."""
    make_trainer("train.steps=9", "train.profile=true").fit()
    assert "Self CPU" in (tmp_path / "profile_rank0.txt").read_text()
    assert json.loads((tmp_path / "profile_rank0.json").read_text()) is None


def test_summary_of_a_chrome_trace(tmp_path):
    """Device work is kernels, memcpys and memsets; device-side annotations (a step's span on the GPU row) are
    not work; steps are the ProfilerStep# annotations; host syncs the runtime's waiting calls."""
    from moe_tune.train.profile import summarize_trace

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        x("user_annotation", "ProfilerStep#6", 0, 1000),
        x("gpu_user_annotation", "ProfilerStep#6", 0, 1000),  # would make the GPU look always busy
        x("kernel", "sm90_xmma_gemm", 100, 300),
        x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 400, 100),
        x("kernel", "ncclDevKernel_AllToAll", 450, 250),  # 500-700 exposed
        x("cuda_runtime", "cudaStreamSynchronize", 800, 10),
        x("cuda_runtime", "cudaLaunchKernel", 810, 5),
        x("cuda_runtime", "cudaMemcpyAsync", 820, 5),  # does not wait for the device
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize_trace(str(path))
    assert _trace_summary([str(path)]) == 0  # benchmarks/trace_summary.py prints it
    assert s["steps"] == 1 and s["kernels_per_step"] == 3 and s["host_syncs_per_step"] == 1
    assert s["gpu_busy_fraction"] == pytest.approx(0.6)  # 100-700 of 0-1000
    assert s["exposed_communication_ms_per_step"] == pytest.approx(0.2)


def _trace_summary(argv: list[str]) -> int:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "trace_summary.py"
    spec = importlib.util.spec_from_file_location("trace_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_trace_summary_refuses_what_it_cannot_summarise(tmp_path, capsys):
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})
    )
    not_a_trace = tmp_path / "summary.json"
    not_a_trace.write_text("null")
    for path, words in ((cpu_only, "no GPU kernels"), (not_a_trace, "not a readable Chrome trace")):
        assert _trace_summary([str(path)]) == 2
        assert words in capsys.readouterr().err
