"""``moe-tune-env`` and ``moe_tune.env.backends``: truthful on this (CPU) machine, clear reasons when unusable."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from moe_tune.cli import env as env_cli
from moe_tune.env import backends
from moe_tune.env import report as env

NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def report() -> dict:
    return env.collect()


def _row(report: dict, name: str) -> dict:
    return next(r for r in report["backends"] if r["backend"] == name)


def test_json_flag_parses_and_lists_every_backend(capsys):
    assert env_cli.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in data["backends"]} == set(backends.BACKENDS)
    assert data["versions"]["torch"] == torch.__version__
    for key in ("python", "CUDA", "NCCL", "transformers", "hydra", "TransformerEngine", "DeepEP"):
        assert data["versions"][key]


def test_text_output_has_one_line_per_backend(capsys):
    assert env_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "GPUs:" in out
    for name in backends.BACKENDS:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert (" ok " in line) or (" unavailable " in line), line


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU report")
def test_grouped_mm_runs_on_cpu_with_numbers(report):
    row = _row(report, "grouped_mm")
    assert row["ok"], row["detail"]
    assert "on cpu" in row["detail"] and "rel err" in row["detail"]
    assert report["gpus"]["count"] == 0


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="DeepEP is installed here")
def test_deepep_missing_says_how_to_build(report):
    row = _row(report, "deepep")
    assert not row["ok"]
    detail = row["detail"]
    assert "not on PyPI" in detail and "v1.2.1" in detail and "nvidia-nvshmem" in detail
    assert "/usr/local/cuda/include/cccl" in detail and "\n" not in detail


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
def test_te_missing_has_reason(report):
    row = _row(report, "transformer_engine")
    assert not row["ok"] and "TransformerEngine is not installed" in row["detail"]


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU report")
def test_symm_mem_and_fp8_without_gpu_have_reason(report):
    for name in ("symm_mem", "fp8_current", "fp8_delayed", "fp8_blockwise", "fp8_mxfp8"):
        row = _row(report, name)
        assert not row["ok"] and "needs a CUDA GPU" in row["detail"], row


def test_mxfp8_refused_on_hopper(monkeypatch):
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA H200", (9, 0)))
    reason = backends.unusable_reason("fp8_mxfp8")
    assert reason is not None
    assert "Blackwell" in reason and "NVIDIA H200 (sm90)" in reason and "kernels.fp8=current" in reason


def test_blockwise_fp8_refused_before_hopper(monkeypatch):
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA L40S", (8, 9)))
    reason = backends.unusable_reason("fp8_blockwise")
    assert reason is not None and "9.0" in reason and "NVIDIA L40S (sm89)" in reason and "fp8=current" in reason


def test_fp8_refused_before_ada(monkeypatch):
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA A100-SXM4-80GB", (8, 0)))
    reason = backends.unusable_reason("fp8_current")
    assert reason is not None and "8.9" in reason and "sm80" in reason


def test_deepep_needs_hopper_when_installed(monkeypatch):
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA A100-SXM4-80GB", (8, 0)))
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    reason = backends.unusable_reason("deepep")
    assert reason is not None and "comm=deepep" in reason and "9.0" in reason


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        backends.unusable_reason("nccl_magic")


def test_parse_topo_two_gpus_with_nic():
    text = (
        "\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tPIX\t0-31\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\t0-31\t0\t\tN/A\n"
        "NIC0\tPIX\tSYS\t X \n\nLegend:\n  X    = Self\n"
    )
    assert env.parse_topo(text) == [{"a": 0, "b": 1, "link": "NV18"}]
    assert env.parse_topo("no GPUs here") == []


@pytest.mark.slow
def test_module_runs_and_imports_nothing_heavy():
    p = subprocess.run([sys.executable, "-m", "moe_tune.env", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["backends"]
    code = "import sys, moe_tune.env; print(sorted(m for m in ('torch', 'transformer_engine', 'deep_ep') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_it_quietly():
    """``moe-tune-env | head -1``: exit 141 as on SIGPIPE, no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "moe_tune.env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"versions"  # the header arrives before the backends' probes run
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 141 and b"Traceback" not in err, err.decode()


def test_package_exports_the_report_and_the_checks():
    import moe_tune.env as pkg

    assert pkg.versions is env.versions and pkg.collect is env.collect
    assert pkg.require_backends is backends.require_backends


@pytest.mark.parametrize("gpu", [None, ("Tesla V100-SXM2-32GB", (7, 0))], ids=["no_gpu", "volta"])
def test_every_refusal_for_the_hardware_names_the_value_to_use_instead(monkeypatch, gpu):
    """Installed everywhere, but no GPU or too old a GPU: each backend's line ends with the fix, as a config error's."""
    monkeypatch.setattr(backends, "_cuda", lambda: gpu)
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    monkeypatch.setattr(backends, "_import_error", lambda module: None)
    refused = {name: backends.unusable_reason(name) for name in backends.BACKENDS}
    refused = {name: reason for name, reason in refused.items() if reason is not None}
    assert {"deepep", "symm_mem", "transformer_engine", "fp8_current", "grouped_mm_fp8"} <= set(refused)
    for name, reason in refused.items():
        assert re.search(r"\b(use|pick) [\w.]+=\w+", reason), (name, reason)
