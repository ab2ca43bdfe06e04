"""The run lock on output_dir: a second run on a directory another live run holds is exit 2 naming the holder
(pid@host, since when), on every rank; a lock file left by a dead run is taken over with a warning."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from moe_tune.train.lock import LOCK_NAME, RunLock, RunLockError, init_run_lock
from tests.harness import FAST_RUN, PY, run_main, run_ranks


def _moe_tune(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "moe_tune", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_exit_2_naming_the_holder(tmp_path, cli_env):
    held = RunLock(str(tmp_path))  # this test process is the first run
    held.acquire()
    try:
        r = _moe_tune([f"output_dir={tmp_path}", "train.steps=1", *FAST_RUN], cli_env)
    finally:
        held.release()
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"is in use by {os.getpid()}@{socket.gethostname()} since " in lines[0], lines[0]
    assert "another output_dir" in lines[0]
    # nothing of the refused run was written beside the lock file
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    stale = f"{2**22 + 12345}@{socket.gethostname()} since 2026-01-01 00:00:00 UTC"
    (tmp_path / LOCK_NAME).write_text(stale + "\n")
    r = run_main([f"output_dir={tmp_path}", "train.steps=1", *FAST_RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"taking over the lock of {stale}" in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released at the end of the run


def test_a_lock_is_free_again_after_release(tmp_path):
    a = RunLock(str(tmp_path))
    a.acquire()
    a.release()
    b = RunLock(str(tmp_path))
    b.acquire()
    assert (tmp_path / LOCK_NAME).read_text().startswith(f"{os.getpid()}@")
    b.release()


def _every_rank_refused(rank: int, out: str) -> None:
    with pytest.raises(RunLockError, match="is in use by"):
        init_run_lock(out, rank)


@pytest.mark.dist
def test_every_rank_gets_rank_0s_verdict(tmp_path):
    held = RunLock(str(tmp_path))
    held.acquire()
    try:
        run_ranks(_every_rank_refused, 2, str(tmp_path))
    finally:
        held.release()


def test_a_finished_run_frees_its_output_dir(make_trainer, tmp_path):
    """Trainer.fit through the Python API leaves output_dir free for another process once the run has finished
    (the process itself may live on, e.g. a notebook)."""
    import fcntl

    make_trainer("train.steps=1").fit()
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while the run still holds it
    finally:
        os.close(fd)


@pytest.mark.parametrize("under", ["", "/run"])
def test_output_dir_on_a_file_is_one_line_and_exit_2(tmp_path, under):
    """A regular file at output_dir (or in place of one of its parents) was Hydra's FileExistsError traceback."""
    (tmp_path / "afile").write_text("mine\n")
    r = run_main([f"output_dir={tmp_path}/afile{under}", "train.steps=1", *FAST_RUN])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    where = "is a file" if not under else f"is under {tmp_path}/afile, which is a file"
    assert r.stderr == (
        f"moe-tune: error: output_dir={tmp_path}/afile{under} {where}, not a directory; give a directory (an "
        "existing one or one to create)\n"
    )
    assert (tmp_path / "afile").read_text() == "mine\n"
