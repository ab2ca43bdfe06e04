"""``moe-tune hydra/launcher=submitit_slurm_cpu ... -m`` on a real Slurm: one task per rank of the layout, every
rank's exit back in the submitter, which exits non-zero with the job's one line when the job fails."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.harness import FAST_RUN, PY, ROOT, cli_env, read_metrics
from tests.slurm.cluster import wait_rows

# A real Slurm runs whole jobs (slow); one Slurm per test session, so under pytest-xdist these tests share a worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


def submit(slurm, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    """``moe-tune`` submitting one job through the launcher and waiting for it, as a user runs it: the installed
    package (the suite's editable install), from a directory outside the clone."""
    cmd = [PY, "-m", "moe_tune", "hydra/launcher=submitit_slurm_cpu", f"output_dir={run_dir}", *FAST_RUN]
    cmd += ["checkpoint.export_hf=false", *overrides, "-m"]
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    env["SLURM_CONF"] = slurm.env["SLURM_CONF"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=240)


def test_ep2_job_runs_two_ranks(slurm, tmp_path):
    r = submit(slurm, tmp_path, "parallel.ep=2", "train.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    job_dir = tmp_path / "multirun" / "0"
    assert json.loads((job_dir / "summary.json").read_text())["world_size"] == 2
    assert [row["step"] for row in read_metrics(job_dir)] == [1, 2, 3, 4]
    results = sorted(p.name.split("_")[1] for p in (tmp_path / "multirun" / ".submitit").glob("*/*_result.pkl"))
    assert results == ["0", "1"]  # one task per rank, each reported back
    # This Slurm keeps no accounting: one note, not a failed sacct poll's lines (sacct's own, and submitit's warning
    # on stdout and again on stderr) at each poll.
    out = r.stdout + r.stderr
    assert out.count("moe-tune: note: Slurm accounting is not available here (sacct: Slurm accounting") == 1, out
    assert "Bypassing sacct error" not in out and out.count("Slurm accounting storage is disabled") == 1, out


def test_a_failing_job_is_the_submitters_exit_2(slurm, tmp_path):
    """A value found wrong inside the job (it needs the world size): the submitter exits 2 with one line naming the
    ranks and the job's error, instead of waiting for a result that never comes."""
    r = submit(slurm, tmp_path, "parallel.ep=2", "train.global_batch_size=3")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("moe-tune: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    # Both ranks find it; the one that fails first makes Slurm stop the other, which may then report no line.
    assert re.search(r"ranks? [01,]+ exited with code 2: train.global_batch_size \(3\) must be a multiple", errors[0])
    assert "Traceback" not in r.stderr
    job = re.search(r"job (\d+):", errors[0]).group(1)
    # Each task exits with its rank's code, as Slurm records it; and the failed job is not requeued (the rank that
    # Slurm sends SIGTERM once the other failed must not take it for a preemption, as submitit would).
    state = slurm.wait(job)
    assert (state.exit_code, state.restarts) == (2, 0), state


def test_time_limit_signal_saves_and_is_the_submitters_143(slurm, tmp_path):
    """Slurm's warning before the time limit (``--signal=TERM@120`` in the job's script; here at once by scancel):
    every rank saves the step they agree on, and the submitter exits 143 with the job's one line."""
    job_dir = tmp_path / "multirun" / "0"
    cmd = [PY, "-m", "moe_tune", "hydra/launcher=submitit_slurm_cpu", f"output_dir={tmp_path}", *FAST_RUN]
    cmd += ["checkpoint.export_hf=false", "parallel.ep=2", "train.steps=1000", "-m"]
    env = {**cli_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    submitter = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    wait_rows(job_dir, 2)
    (script,) = (tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")
    assert "#SBATCH --signal=TERM@120" in script.read_text()
    slurm.run(["scancel", "--signal=TERM", script.name.split("_")[0]])
    _, err = submitter.communicate(timeout=120)
    assert submitter.returncode == 143, err[-3000:]
    assert re.search(r"moe-tune: error: job \d+: ranks 0,1 exited with code 143\n", err), err[-3000:]
    assert [d.name for d in (job_dir / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]


def test_with_requeues_left_a_stopped_job_requeues_and_finishes(slurm, tmp_path):
    """``hydra.launcher.max_num_timeout=1``: the time-limit warning (here at once by scancel) makes every rank save,
    rank 0 requeue the job with one requeue fewer, and the job's second attempt resume from that checkpoint and
    finish; the submitter waits through it and exits 0 (each step's metrics row once across both attempts)."""
    job_dir = tmp_path / "multirun" / "0"
    cmd = [PY, "-m", "moe_tune", "hydra/launcher=submitit_slurm_cpu", f"output_dir={tmp_path}", *FAST_RUN]
    cmd += ["checkpoint.export_hf=false", "parallel.ep=2", "train.steps=120", "hydra.launcher.max_num_timeout=1", "-m"]
    env = {**cli_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    submitter = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    wait_rows(job_dir, 2)
    (script,) = (tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")
    job = script.name.split("_")[0]
    slurm.run(["scancel", "--signal=TERM", job])
    _, err = submitter.communicate(timeout=240)
    assert submitter.returncode == 0, err[-3000:]
    assert [row["step"] for row in read_metrics(job_dir)] == list(range(1, 121)), err[-3000:]
    logs = "".join(p.read_text() for p in sorted((tmp_path / "multirun" / ".submitit").glob("*/*_0_log.*")))
    assert "requeued (0 requeues left)" in logs and "resuming from" in logs, logs[-3000:]
