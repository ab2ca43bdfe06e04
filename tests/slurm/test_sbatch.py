"""``launch/slurm/train.sbatch`` on a real Slurm: the default fine-tune as 2 CPU ranks (EP=2 on gloo) on a node
without GPUs, stopped as Slurm's time limit and ``scancel -s TERM`` stop it, requeued, resumed from the checkpoint
saved at the stop; the job's exit code is the ranks' own."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.harness import FAST_RUN, ROOT, cli_env, read_metrics
from tests.slurm.cluster import wait_rows

# A real Slurm runs whole jobs (slow); one Slurm per test session, so under pytest-xdist these tests share a worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


SBATCH = str(Path(ROOT) / "launch" / "slurm" / "train.sbatch")
STOP_LINE = "moe-tune: stopped by signal 15"  # the launcher's
SAVED_LINE = "stopped by signal 15 after step"  # the trainer's, rank 0 only


def submit(slurm, run_dir: Path, steps: int, options: tuple[str, ...] = ()) -> str:
    """The script as a user submits it, two ranks on a CPU node (``options``: more of sbatch's); returns the job
    id."""
    overrides = [f"output_dir={run_dir}", f"train.steps={steps}", "parallel.ep=2", "checkpoint.export_hf=false"]
    env = {**cli_env(), "SLURM_CONF": slurm.env["SLURM_CONF"], "NPROC_PER_NODE": "2"}
    return slurm.sbatch(["--cpus-per-task=2", f"--chdir={ROOT}", *options, SBATCH, *overrides, *FAST_RUN], env=env)


def job_log(run_dir: Path, job: str) -> str:
    """The job's own log: under the run directory, every attempt appended."""
    return (run_dir / "logs" / f"slurm-{job}.out").read_text()


def wait_ended(slurm, run_dir: Path, job: str, restarts: int, timeout_s: float = 240):
    """Slurm's state of the job once the attempt Slurm counts has run and ended. A requeue counts in ``Restarts`` at
    once, and for a moment the attempt that requeued itself can read FAILED (CI caught it once, for a task of an
    array): the log's header of attempt ``Restarts`` and one exit line per attempt say that attempt ran."""
    deadline = time.time() + timeout_s
    while True:
        state = slurm.wait(job, max(deadline - time.time(), 1), restarts)
        log = job_log(run_dir, job)
        attempts = log.count(f"moe-tune: job {job} (restart ")
        if f"(restart {state.restarts}) on" in log and log.count(f"moe-tune: job {job} exited with") == attempts:
            return state
        if time.time() > deadline:
            raise TimeoutError(f"job {job} reads {state} but its log has not caught up:\n{log[-2000:]}")
        time.sleep(0.5)


def saved_step(log: str) -> int:
    return int(re.search(r"stopped by signal 15 after step (\d+)", log).group(1))


def test_time_limit_signal_saves_requeues_and_resumes(slurm, tmp_path):
    """``--signal=B:TERM@120`` reaches the batch script (here at once, by ``scancel --batch``): the ranks save the
    step they agree on, the job requeues itself, resumes from that checkpoint and finishes with exit code 0."""
    run = tmp_path / "run"
    # Steps enough that the signal lands in training on a loaded 2-core machine (at 30, CI once finished them first).
    job = submit(slurm, run, steps=60)
    wait_rows(run, 2)
    slurm.run(["scancel", "--batch", "--signal=TERM", job])
    state = wait_ended(slurm, run, job, restarts=1)
    log = job_log(run, job)
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 1), log[-3000:]
    step = saved_step(log)
    assert f"resuming from {run}/checkpoints/step_{step}" in log, log[-3000:]
    assert log.count(STOP_LINE) == log.count(SAVED_LINE) == 1 and f"job {job} exited with 143" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 61))  # each step once, across both attempts
    assert not list(Path(ROOT).glob(f"*{job}.out"))  # no log in the directory it was submitted from


def test_scancel_term_is_exit_143_and_a_requeue_resumes(slurm, tmp_path):
    """``scancel -s TERM`` (what preemption sends): the ranks save and Slurm records their 143, one stop line for
    the job; ``scontrol requeue`` runs it again from that checkpoint to the end, exit code 0."""
    run = tmp_path / "run"
    job = submit(slurm, run, steps=60)  # steps enough for scancel to land in training on a loaded machine
    wait_rows(run, 2)
    slurm.run(["scancel", "--signal=TERM", job])
    state = slurm.wait(job, timeout_s=120)
    log = job_log(run, job)
    assert (state.state, state.exit_code) == ("FAILED", 143), log[-3000:]
    step = saved_step(log)
    assert (run / "checkpoints" / f"step_{step}" / "COMPLETE").exists(), log[-3000:]
    assert log.count(STOP_LINE) == log.count(SAVED_LINE) == 1 and "Traceback" not in log, log[-3000:]
    slurm.run(["scontrol", "requeue", job])
    state = wait_ended(slurm, run, job, restarts=1)
    log = job_log(run, job)
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 1), log[-3000:]
    assert f"resuming from {run}/checkpoints/step_{step}" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 61))


def test_scancel_cancels_without_a_requeue(slurm, tmp_path):
    """A plain ``scancel <job>`` (TERM to the batch script as well as the steps) cancels the job: the ranks save
    the step they agree on and the script does not requeue it (the pre-timeout warning alone does)."""
    run = tmp_path / "run"
    job = submit(slurm, run, steps=40)
    wait_rows(run, 2)
    slurm.run(["scancel", job])
    state = slurm.wait(job, timeout_s=120)
    time.sleep(3)  # a requeue by the script would show by now
    state = slurm.job(job)
    log = job_log(run, job)
    assert (state.state, state.restarts) == ("CANCELLED", 0), log[-3000:]
    assert "requeued; it resumes" not in log and "Invalid job id" not in log, log[-3000:]
    assert (run / "checkpoints" / f"step_{saved_step(log)}" / "COMPLETE").exists(), log[-3000:]


def test_time_limit_signal_requeues_a_task_of_a_job_array(slurm, tmp_path):
    """A job array chaining one run (``--array=0-2%1``): Slurm refuses a signal to a task's whole job while other
    tasks are pending (scancel retries it without end), so the script signals the task's step: the ranks save, the
    task requeues itself and ends with 0, the run's steps each once (the other tasks resume it or find it
    finished)."""
    run = tmp_path / "run"
    array = submit(slurm, run, steps=60, options=("--array=0-2%1",))  # steps enough for scancel to land in training
    wait_rows(run, 2)
    task = slurm.run(["squeue", "-h", "-j", f"{array}_0", "-o", "%A"]).stdout.strip()  # running: its own job id
    slurm.run(["scancel", "--batch", "--signal=TERM", task])  # its retries may signal the next attempt too
    state = wait_ended(slurm, run, task, restarts=1)
    log = job_log(run, task)
    assert (state.state, state.exit_code) == ("COMPLETED", 0) and state.restarts >= 1, log[-3000:]
    assert SAVED_LINE in log and f"job {task} exited with 143" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 61))
