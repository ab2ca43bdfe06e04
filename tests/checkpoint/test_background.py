"""Background checkpoint writes (``checkpoint.async_save``): the saved state is the step's, however training changes
the tensors while the files are written; the next save, the end of the run and a signal stop wait for the write;
a kill during a write leaves the previous checkpoint as the resume point (two gloo ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import moe_tune.checkpoint as ckpt
from moe_tune.checkpoint import background, manifest
from tests.harness import FAST_RUN, PY, ROOT, cli_env, read_metrics, run_cli
from tests.train.conftest import make_trainer  # noqa: F401  (the trainer fixture, for this directory too)


def _ckpt(out, step: int) -> str:
    return os.path.join(str(out), "checkpoints", f"step_{step}")


class _Gate:
    """A storage writer for ``moe_tune.checkpoint.background.storage_writer`` whose writes wait until ``opened`` is set, then
    ``delay`` seconds more."""

    def __init__(self, delay: float = 0.0):
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.delay = delay

    def __call__(self, path: str):
        gate = self

        class Gated(FileSystemWriter):
            def write_data(self, plan, planner):
                gate.waiting.set()
                assert gate.opened.wait(60), "the test never opened the gate"
                time.sleep(gate.delay)
                return super().write_data(plan, planner)

        return Gated(path, sync_files=True)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, manifest.COMPLETE))


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_a_background_save_writes_the_step_it_was_asked_for(tmp_path, make_trainer, monkeypatch):  # noqa: F811
    """Training changes the weights while the write waits; the checkpoint still loads as the saved step's."""
    gate = _Gate()
    monkeypatch.setattr(background, "storage_writer", gate)
    trainer = make_trainer("train.steps=6", "checkpoint.async_save=true", out=str(tmp_path / "a"))
    for i in range(2):
        trainer.train_step(i)
    trainer.step = 2
    at_save = _params(trainer.model)
    stall = ckpt.save(trainer.checkpoint_state(), trainer.step, _ckpt(tmp_path / "a", 2), trainer.saver)
    assert gate.waiting.wait(30) and trainer.saver.pending()  # save returned with the write still to come
    assert stall < 30
    for i in range(2, 4):  # training goes on: the live tensors move
        trainer.train_step(i)
    assert any(not torch.equal(at_save[k], v) for k, v in _params(trainer.model).items())
    assert not _complete(_ckpt(tmp_path / "a", 2))
    gate.opened.set()
    trainer.saver.wait()
    assert _complete(_ckpt(tmp_path / "a", 2))
    assert manifest.verify(_ckpt(tmp_path / "a", 2)) is None

    fresh = make_trainer("train.steps=6", f"checkpoint.resume={_ckpt(tmp_path / 'a', 2)}", out=str(tmp_path / "b"))
    assert fresh.step == 2
    loaded = _params(fresh.model)
    assert loaded.keys() == at_save.keys()
    for k in at_save:
        assert torch.equal(loaded[k], at_save[k]), k


def test_async_and_sync_saves_resume_to_the_same_run(tmp_path, make_trainer):  # noqa: F811
    """A run resumed from a background save ends bitwise where one resumed from a synchronous save does."""
    final = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        make_trainer("train.steps=4", "checkpoint.every=2", f"checkpoint.async_save={mode}", out=str(out)).fit()
        assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_4"]
        for step in (2, 4):
            assert manifest.verify(_ckpt(out, step)) is None  # COMPLETE's sizes and checksums match the files
        resumed = make_trainer("train.steps=6", f"checkpoint.resume={_ckpt(out, 2)}", out=str(tmp_path / f"r{mode}"))
        resumed.fit()
        final[mode] = _params(resumed.model)
    for k, v in final["true"].items():
        assert torch.equal(v, final["false"][k]), k


def test_the_next_save_and_a_signal_stop_wait_for_the_write(tmp_path, make_trainer, monkeypatch):  # noqa: F811
    """A save while the previous write is in flight waits for it; a signal stop's checkpoint is complete at exit."""
    gate = _Gate(delay=2.0)  # every write: step 5's is still in flight when the loop stops
    monkeypatch.setattr(background, "storage_writer", gate)
    trainer = make_trainer("train.steps=20", "checkpoint.every=2", "train.log_every=1", out=str(tmp_path))
    original = trainer.train_step

    def step(i):
        if i == 3:  # step 4: the save of step 2 is still waiting at the gate
            assert trainer.saver.pending() and not _complete(_ckpt(tmp_path, 2))
            threading.Timer(1.0, gate.opened.set).start()
        if i == 4:  # step 5: the save of step 4 waited for step 2's
            assert _complete(_ckpt(tmp_path, 2))
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(i)

    trainer.train_step = step
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    assert e.value.code == 128 + signal.SIGUSR1
    assert not trainer.saver.pending()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_2", "step_4", "step_5"]  # step 5: the stop's
    for s in (2, 4, 5):
        assert manifest.verify(_ckpt(tmp_path, s)) is None


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


def _kill_tree(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and its ranks (each rank is in a session of its own), and wait until the ranks are gone."""
    ranks = _descendants(job.pid)
    for pid in [job.pid, *ranks]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(60)
    deadline = time.time() + 60
    while any(_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has closed its files: the lock is free
    except OSError:
        return False


@pytest.mark.dist
@pytest.mark.slow
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """Two gloo ranks save every 2 steps; the write of step 4 is held while training goes on; kill -9 the whole
    job; resume=auto starts from step 2 and names step_4 as incomplete."""
    out = tmp_path / "run"
    env = {**cli_env(), "SLOW_SAVE_FROM_STEP": "4", "SLOW_SAVE_GATE": str(tmp_path / "never")}
    overrides = [f"output_dir={out}", "train.steps=10", "checkpoint.every=2", "train.log_every=1", *FAST_RUN]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    job = subprocess.Popen(
        [*cmd, "tests.checkpoint.slow_writer", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        rows = []
        while time.time() < deadline and job.poll() is None:  # step 5 trained while step 4's write is held
            rows = read_metrics(out) if (out / "metrics.jsonl").exists() else []
            if len(rows) >= 5:
                break
            time.sleep(0.2)
        assert len(rows) >= 5, job.stderr.read() if job.poll() is not None else f"{len(rows)} rows after 300 s"
        assert os.path.isdir(_ckpt(out, 4)) and not _complete(_ckpt(out, 4))
    finally:
        _kill_tree(job)
    assert _complete(_ckpt(out, 2))

    r = run_cli([*overrides, "checkpoint.resume=auto", "train.steps=6"], cli_env(), nproc=2)
    assert f"resuming from {_ckpt(out, 2)}" in r.stderr
    assert "step_4" in r.stderr  # the incomplete checkpoint passed over is named
    assert [row["step"] for row in read_metrics(out)] == list(range(1, 7))
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_4", "step_6"]
    assert manifest.verify(_ckpt(out, 4)) is None  # written anew by the resumed run


def test_the_host_copy_is_made_before_the_first_save_and_reused(tmp_path, make_trainer):  # noqa: F811
    """The first sync step allocates the copy (on a thread); every save stages into those same tensors."""
    trainer = make_trainer("train.steps=6", "checkpoint.every=3", "train.log_every=1", out=str(tmp_path))
    original = trainer.train_step
    seen = []

    def step(i):
        if i == 1:  # after step 1's sync step, before any save
            trainer.saver._preparing.join()
            seen.append({k: v.data_ptr() for k, v in trainer.saver._staged.items()})
        return original(i)

    trainer.train_step = step
    trainer.fit()
    assert seen and {k: v.data_ptr() for k, v in trainer.saver._staged.items()} == seen[0]
    for s in (3, 6):
        assert manifest.verify(_ckpt(tmp_path, s)) is None


def test_a_host_copy_that_does_not_fit_saves_synchronously(tmp_path, make_trainer, monkeypatch, capfd):  # noqa: F811
    monkeypatch.setattr(background, "_mem_available", lambda: 1 << 10)
    trainer = make_trainer("train.steps=4", "checkpoint.every=2", out=str(tmp_path))
    trainer.fit()
    assert not trainer.saver.async_save and trainer.saver._staged is None
    assert capfd.readouterr().err.count("every save of this run is synchronous") == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_2", "step_4"]
