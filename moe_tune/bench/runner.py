"""One benchmark row: launch a training entry point in its own process group lifetime, then read its
summary.json and metrics.jsonl, or say why there are none (``oom`` or ``error: <reason>``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field

OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "DefaultCPUAllocator: can't allocate memory")
# Launcher noise that follows the real error in a torchrun failure: never the reason.
_NOISE = re.compile(r"ChildFailedError|torch\.distributed\.elastic|^[=\-\s^~]*$|^(Traceback|File |raise )|it/s\]|\d%\|")
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")
_ERROR_LINE = re.compile(r"(\b\w*(Error|Exception)\b.*:|^moe-tune[\w -]*: error:|^error:)")
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")  # fmt: skip


@dataclass
class Row:
    variant: str
    kind: str
    status: str = "not run"
    tokens_per_s_per_gpu: float | None = None  # real tokens (not padding)
    row_fill: float | None = None  # real tokens / row positions
    tflops_per_gpu: float | None = None
    peak_mem_gib: float | None = None
    peak_reserved_gib: float | None = None
    final_loss: float | None = None
    config: dict = field(default_factory=dict)
    flops_per_token: float | None = None
    steps_timed: int | None = None
    losses: list[float] = field(default_factory=list)
    run_dir: str | None = None
    command: str | None = None
    wall_s: float | None = None
    note: str | None = None
    resolved_config: dict | None = None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(mfu=None, max_loss_diff_vs_baseline=None, max_loss_rel_diff_vs_reference=None)
        return d

    def one_line(self) -> str:
        if self.status != "ok":
            return self.status
        return f"ok, {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {self.peak_mem_gib:.1f} GiB, final loss {self.final_loss:.4f}"


def split_overrides(text: str) -> list[str]:
    """Split ``a=1,b=[1,2],c='x,y'`` on the commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


def launch_command(module: str, args: list[str], nproc: int) -> list[str]:
    """One process: plain ``python -m``; more: ``torchrun --standalone`` (a fresh rendezvous on a free port)."""
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher variables, with this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in ((extra or {}).get("PYTHONPATH"), root, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def failure_reason(stderr: str, returncode: int) -> str:
    """``oom`` or ``error: <the line that says what went wrong>``."""
    if any(m in stderr for m in OOM_MARKERS):
        return "oom"
    lines = [_RANK_PREFIX.sub("", ln).strip() for ln in stderr.splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not _NOISE.search(ln)]
    reason = errors[-1] if errors else next((ln for ln in reversed(lines) if not _NOISE.search(ln)), "")
    reason = re.sub(r"^moe-tune[\w -]*: error:\s*", "", reason)
    if not reason:
        reason = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}, no message"
    return f"error: {reason[:300]}"


def _run(cmd: list[str], run_dir: str, env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` with its output in run_dir/{stdout,stderr}.log; on timeout end its whole process group."""
    with open(os.path.join(run_dir, "stdout.log"), "w") as out, open(os.path.join(run_dir, "stderr.log"), "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)  # the group this Popen started (torchrun and its ranks)
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
    with open(os.path.join(run_dir, "stderr.log"), errors="replace") as f:
        return rc, f.read()


def read_run(row: Row, run_dir: str) -> bool:
    """Fill ``row`` from run_dir/summary.json and metrics.jsonl; False if there is no summary."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        s = json.load(f)
    for key in ("tokens_per_s_per_gpu", "row_fill", "tflops_per_gpu", "peak_mem_gib", "peak_reserved_gib", "final_loss",
                "flops_per_token", "steps_timed"):  # fmt: skip
        setattr(row, key, s.get(key))
    row.resolved_config = s.get("config")
    row.config.update(s.get("bench_config", {}))
    if s.get("experts_implementation") and row.config.get("experts") not in (None, s["experts_implementation"]):
        row.note = f"transformers ran experts_implementation={s['experts_implementation']!r}"
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            row.losses = [json.loads(line)["loss"] for line in f if line.strip()]
    return True


def run_row(
    row: Row,
    module: str,
    args: list[str],
    overrides: list[str],
    run_dir: str,
    nproc: int,
    timeout_s: float,
    env_extra: dict[str, str] | None = None,
) -> Row:
    """Run one row in ``run_dir`` (created fresh) and fill it in place."""
    import time

    os.makedirs(run_dir, exist_ok=True)
    cmd = launch_command(module, [*args, *overrides, f"output_dir={run_dir}"], nproc)
    row.run_dir, row.command = run_dir, shlex.join(["python", *cmd[1:]])
    t0 = time.perf_counter()
    rc, stderr = _run(cmd, run_dir, child_env(env_extra), timeout_s)
    row.wall_s = time.perf_counter() - t0
    if rc is None:
        row.status = f"error: timeout after {timeout_s:.0f} s"
    elif rc != 0:
        row.status = failure_reason(stderr, rc)
    elif read_run(row, run_dir):
        row.status = "ok"
    else:
        row.status = "error: finished without writing summary.json"
    return row
