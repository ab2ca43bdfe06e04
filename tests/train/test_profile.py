"""train.profile=true: the step summary (GPU busy, exposed communication) from device-kernel intervals."""

from __future__ import annotations

import json
import logging

import pytest
import torch

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


def _traced_steps(trace_path) -> tuple[list[int], list[int]]:
    """(the trace's ProfilerStep#N numbers, the steps N whose "step N" annotation lies inside ProfilerStep#N)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}
    inside = []
    for e in events:
        if e["name"].startswith("step ") and int(e["name"][5:]) in spans:
            span = spans[int(e["name"][5:])]
            if span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"]:
                inside.append(int(e["name"][5:]))
    return sorted(spans), sorted(inside)


class _ProfileLines(logging.Handler):
    """The moe_tune logger's lines about train.profile (the Trainer reconfigures the root logger's handlers, so
    pytest's caplog would miss them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "train.profile" in record.getMessage():
            self.lines.append(record.getMessage())


@pytest.fixture
def profile_lines():
    handler = _ProfileLines()
    logger = logging.getLogger("moe_tune")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_profiled_run_traces_the_steps_it_names(tmp_path, make_trainer, profile_lines):
    """The start's line names the steps as the log and metrics.jsonl number them, and those are what the trace holds,
    under the same ProfilerStep numbers (the trace counted from 0: ProfilerStep#6-8 held steps 7-9). On CPU the
    trace has no device kernels: the table is written and the summary is null."""
    from torch.profiler import record_function

    trainer = make_trainer("train.steps=9", "train.profile=true", "train.log_every=1")
    train_step = trainer.train_step

    def annotated(step):  # train_step(step) makes the row numbered step + 1
        with record_function(f"step {step + 1}"):
            return train_step(step)

    trainer.train_step = annotated
    trainer.fit()
    assert profile_lines == [
        "train.profile=true: rank 0 traces steps 7-9 (ProfilerStep#7-9 in trace_rank0.json), after 5 untraced steps "
        "and 1 that warms the profiler up"
    ]
    assert _traced_steps(tmp_path / "trace_rank0.json") == ([7, 8, 9], [7, 8, 9])
    assert "Self CPU" in (tmp_path / "profile_rank0.txt").read_text()
    assert json.loads((tmp_path / "profile_rank0.json").read_text()) is None


def test_a_resumed_run_traces_from_its_start(tmp_path, profile_lines):
    """After step 100 the run traces steps 107-109, named so; ending before them it traces nothing and says so."""
    from torch.profiler import record_function

    from moe_tune.train import profile

    profiler = profile.build_profiler(True, 0, str(tmp_path), start_step=100, steps=110)
    for step in range(101, 111):  # the trainer's loop: the step's work, then step()
        with record_function(f"step {step}"):
            torch.ones(8, 8).matmul(torch.ones(8, 8))
        profiler.step()
    profiler.stop()
    assert profile_lines[0].startswith("train.profile=true: rank 0 traces steps 107-109 (ProfilerStep#107-109 in ")
    assert _traced_steps(tmp_path / "trace_rank0.json") == ([107, 108, 109], [107, 108, 109])
    assert isinstance(profile.build_profiler(True, 0, str(tmp_path), start_step=100, steps=105), profile.NoProfiler)
    assert profile_lines[1] == (
        "note: train.profile=true traces steps 107-109 of a run resumed after step 100, and this one ends at step "
        "105: nothing is traced; set train.steps=109 or more"
    )


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


def _trace_summary_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "trace_summary.py"
    spec = importlib.util.spec_from_file_location("trace_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace_summary(argv: list[str]) -> int:
    return _trace_summary_module().main(argv)


def test_idle_gaps_name_the_late_host_op(tmp_path):
    """An idle GPU before a kernel the host launched late is put on the host op around that launch; one before a
    kernel launched early is not the host's; gaps shorter than the threshold and outside the steps are left out."""

    def x(cat, name, ts, dur, tid=1, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {"correlation": corr}}

    events = [
        x("user_annotation", "ProfilerStep#7", 0, 2000),
        x("kernel", "gemm_a", 0, 100, tid=7, corr=1),
        x("cpu_op", "aten::nonzero", 150, 200),  # the host busy in an op, then launching inside it
        x("cpu_op", "aten::copy_", 300, 40),
        x("cuda_runtime", "cudaLaunchKernel", 320, 5, corr=2),
        x("kernel", "gemm_b", 400, 100, tid=7, corr=2),  # idle 100-400: host late, in aten::copy_
        x("cuda_runtime", "cudaLaunchKernel", 60, 5, corr=3),
        x("kernel", "gemm_c", 550, 100, tid=7, corr=3),  # idle 500-550: launched early (waited on something else)
        x("kernel", "gemm_d", 660, 100, tid=7, corr=4),  # idle 10 us: under the threshold
        x("kernel", "gemm_e", 3000, 100, tid=7, corr=5),  # after the traced step
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = _trace_summary_module().gaps_report(str(path), top=5, min_gap_us=20)
    assert report["idle_ms_host_late"] == pytest.approx(0.3)
    assert report["idle_ms_waiting_otherwise"] == pytest.approx(0.05)
    assert report["host_late_ms_by_op"] == {"aten::copy_": pytest.approx(0.3)}
    assert [(g["before"], g["after"], g["host_late"]) for g in report["longest"]] == [
        ("gemm_a", "gemm_b", True),
        ("gemm_b", "gemm_c", False),
    ]
    assert _trace_summary(["--gaps", "3", str(path)]) == 0


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
