"""Checkpoint integrity: COMPLETE holds a manifest (sizes, CRC-32) that every load checks; a damaged checkpoint is
passed over for the one before it (resume=auto) or refused (a named path, none intact: exit 2); NaN/inf in source
weights or resumed state is refused naming the tensor; a full disk during a save is one line and exit 1."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

from moe_tune.checkpoint import latest, manifest, safe
from moe_tune.config import CheckpointError
from tests.harness import FAST_RUN, read_metrics, run_main
from tests.train.conftest import make_trainer, trainer_for  # noqa: F401  (the trainer fixture, for this directory too)


def _run(make_trainer, out, steps: int, *overrides) -> object:  # noqa: F811
    trainer = make_trainer(f"train.steps={steps}", "checkpoint.every=2", *overrides, out=str(out))
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """One 4-step run (checkpoints of steps 2 and 4), trained once for this module."""
    from moe_tune.distributed.process_group import destroy_distributed

    out = tmp_path_factory.mktemp("four_steps")
    try:
        trainer_for(out, "train.steps=4", "checkpoint.every=2").fit()
    finally:
        destroy_distributed()
    return out


@pytest.fixture
def four_steps(tmp_path, trained_once):
    """A copy of ``trained_once`` in this test's tmp_path (returned), for the test to damage."""
    shutil.copytree(trained_once, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _ckpt(out, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{step}")


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:  # flip: the same size, a few bytes inverted in the middle
        with open(path, "r+b") as f:
            f.seek(size // 2)
            data = f.read(8)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in data))


def _warnings(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(manifest.log, "warning", lambda msg, *args: lines.append(msg % args))
    return lines


def test_complete_holds_a_manifest_of_every_file(four_steps):
    path = _ckpt(four_steps, 2)
    body = json.loads(open(os.path.join(path, "COMPLETE")).read())
    assert body["step"] == 2 and body["hash"] == "crc32"
    names = sorted(n for n in os.listdir(path) if n != "COMPLETE")
    assert sorted(body["files"]) == names and {".metadata", "meta.json", "__0_0.distcp"} <= set(names)
    for name, entry in body["files"].items():
        assert entry == {"size": os.path.getsize(os.path.join(path, name)), "crc32": manifest.crc32(f"{path}/{name}")}
    assert manifest.verify(path) is None


@pytest.mark.parametrize(
    "name, how",
    [
        ("__0_0.distcp", "truncate"),
        ("__0_0.distcp", "delete"),
        (".metadata", "truncate"),
        (".metadata", "delete"),
        ("meta.json", "truncate"),
        ("meta.json", "delete"),
    ],
)
def test_auto_resume_passes_over_a_damaged_checkpoint(four_steps, make_trainer, monkeypatch, name, how):  # noqa: F811
    _damage(os.path.join(_ckpt(four_steps, 4), name), how)
    warnings = _warnings(monkeypatch)
    resumed = make_trainer("train.steps=6", "checkpoint.every=2", out=str(four_steps))
    assert resumed.step == 2
    assert len(warnings) == 1 and os.path.join(_ckpt(four_steps, 4), name) in warnings[0], warnings


def test_flipped_bytes_fall_back_and_train_as_from_the_previous_checkpoint(
    tmp_path,
    make_trainer,  # noqa: F811
    monkeypatch,
    trained_once,
):
    reference = [r["loss"] for r in read_metrics(_run(make_trainer, tmp_path / "ref", 6).cfg.output_dir)]
    shutil.copytree(trained_once, tmp_path / "run")
    shard = os.path.join(_ckpt(tmp_path / "run", 4), "__0_0.distcp")
    _damage(shard, "flip")
    warnings = _warnings(monkeypatch)
    resumed = make_trainer("train.steps=6", "checkpoint.every=2", out=str(tmp_path / "run"))
    assert resumed.step == 2 and len(warnings) == 1 and shard in warnings[0] and "checksum" in warnings[0]
    resumed.fit()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == reference  # bitwise: steps 3-6 replayed from step_2


def test_no_intact_checkpoint_is_a_checkpoint_error_naming_the_file(four_steps, make_trainer):  # noqa: F811
    _damage(os.path.join(_ckpt(four_steps, 4), "__0_0.distcp"), "flip")
    _damage(os.path.join(_ckpt(four_steps, 2), ".metadata"), "delete")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as e:
        make_trainer("train.steps=6", out=str(four_steps))
    assert os.path.join(_ckpt(four_steps, 4), "__0_0.distcp") in str(e.value)
    assert "\n" not in str(e.value)


def test_a_named_damaged_checkpoint_is_refused(four_steps, make_trainer):  # noqa: F811
    _damage(os.path.join(_ckpt(four_steps, 4), "meta.json"), "truncate")
    with pytest.raises(CheckpointError, match="meta.json has"):
        make_trainer("train.steps=6", f"checkpoint.resume={_ckpt(four_steps, 4)}", out=str(four_steps))


def test_an_old_complete_without_manifest_still_resumes(four_steps, make_trainer, monkeypatch):  # noqa: F811
    with open(os.path.join(_ckpt(four_steps, 4), "COMPLETE"), "w") as f:
        f.write("4")  # as moe-tune wrote it before the manifest
    warnings = _warnings(monkeypatch)
    assert make_trainer("train.steps=6", out=str(four_steps)).step == 4
    assert len(warnings) == 1 and "no integrity manifest" in warnings[0]


def test_nonfinite_resumed_state_is_refused_naming_the_tensor(tmp_path, make_trainer):  # noqa: F811
    trainer = _run(make_trainer, tmp_path, 2)
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    trainer.save()  # a valid manifest over a NaN weight
    with pytest.raises(CheckpointError, match=f"tensor {name} holds NaN"):
        make_trainer("train.steps=4", out=str(tmp_path))


def test_nan_in_source_weights_is_refused_naming_the_tensor(tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    import moe_tune

    path = tiny_checkpoint()
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    key = sorted(k for k in tensors if k.endswith("self_attn.q_proj.weight"))[0]
    tensors[key][1, 2] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {key} holds NaN or inf"):
        moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "no space left on device"),
        (errno.EDQUOT, "disk quota exceeded"),  # a user's quota
        (errno.EROFS, "read-only file system"),  # a filesystem remounted read-only under the run
    ],
)
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path,
    make_trainer,  # noqa: F811
    monkeypatch,
    code,
    words,
):
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def full_at_step_4(self, plan, planner):
        if str(self.path).endswith("step_4"):
            raise OSError(code, os.strerror(code))
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_at_step_4)
    errors: list[str] = []
    monkeypatch.setattr(safe.log, "error", lambda msg, *args: errors.append(msg % args))
    trainer = make_trainer("train.steps=6", "checkpoint.every=2", out=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    assert e.value.code == 1
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"saving checkpoint {_ckpt(tmp_path, 4)} failed: {words} (")
    assert f"previous checkpoint {_ckpt(tmp_path, 2)} is intact" in errors[0]
    fix = "Make" if code == errno.EROFS else "Free space in"
    assert f". {fix} {tmp_path / 'checkpoints'}" in errors[0], errors[0]
    assert not os.path.exists(_ckpt(tmp_path, 4))  # nothing that could look complete
    assert latest(str(tmp_path)) == _ckpt(tmp_path, 2) and manifest.verify(_ckpt(tmp_path, 2)) is None


def test_a_writer_threads_failure_fails_the_save_without_its_traceback(tmp_path, make_trainer, monkeypatch, capfd):  # noqa: F811
    """DCP writes a save's files on eight threads and, when one of its own threads fails (not the caller's share),
    prints that thread's traceback and returns as if every file were written: the checkpoint would be marked
    COMPLETE without them. The save fails instead (no COMPLETE: a resume passes over it), the error raised where
    the run waits for the save, and no thread prints a traceback."""
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystem

    create_stream = FileSystem.create_stream
    failed = threading.Event()

    def worker_fails_at_step_4(self, path, mode):
        if "step_4" in str(path):
            if "_write_files_from_queue" in threading.current_thread().name:
                failed.set()
                raise OSError(errno.EIO, "Input/output error")
            failed.wait(timeout=10)  # the caller's own share: after a worker failed
        return create_stream(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", worker_fails_at_step_4)
    trainer = make_trainer("train.steps=6", "checkpoint.every=2", out=str(tmp_path))
    with pytest.raises(OSError, match="Input/output error"):
        trainer.fit()
    assert failed.is_set()  # a writer thread did fail
    assert latest(str(tmp_path)) == _ckpt(tmp_path, 2) and manifest.verify(_ckpt(tmp_path, 2)) is None
    assert "Exception in thread" not in capfd.readouterr().err


def test_export_of_a_damaged_checkpoint_is_exit_2_naming_the_file(four_steps, capsys):
    from moe_tune.cli.export import main

    shard = os.path.join(_ckpt(four_steps, 2), "__0_0.distcp")
    _damage(shard, "flip")
    with pytest.raises(SystemExit) as e:
        main([_ckpt(four_steps, 2), str(four_steps / "hf")])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the training run's own log lines
    assert line.startswith("moe-tune-export: error: checkpoint") and shard in line and "checksum" in line


@pytest.mark.parametrize("existing", ["cut_short", "complete"])
def test_a_save_into_an_existing_step_directory_replaces_it_without_dcps_overwrite_warning(
    four_steps,
    make_trainer,  # noqa: F811
    existing,
):
    """A save into a step directory that holds a save already is preceded by removing it whole: no stray file of it
    stays, and DCP finds no .metadata to warn about overwriting. ``cut_short``: a directory without COMPLETE (a save
    cut short after DCP's .metadata, or damaged), passed over by the resume. ``complete``: a complete checkpoint,
    saved over by a run resumed on purpose from an earlier one (checkpoint.resume=<path>)."""
    import warnings

    step_2, step_4 = _ckpt(four_steps, 2), _ckpt(four_steps, 4)
    os.remove(os.path.join(four_steps, "summary.json"))  # stopped before its outputs: not a finished run
    resume = []
    if existing == "cut_short":
        os.remove(os.path.join(step_4, manifest.COMPLETE))
    else:
        resume = [f"checkpoint.resume={step_2}"]
    stray = os.path.join(step_4, "__9_0.distcp")
    open(stray, "wb").close()
    trainer = make_trainer("train.steps=4", "checkpoint.every=2", *resume, out=str(four_steps))
    assert trainer.step == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    assert not [w for w in caught if "existing checkpoint" in str(w.message)], [str(w.message) for w in caught]
    assert not os.path.exists(stray)
    assert latest(str(four_steps)) == step_4 and manifest.verify(step_4) is None


def test_disk_full_writing_a_metrics_row_is_one_line_and_a_rerun_resumes(tmp_path, monkeypatch):
    """The disk fills while training (an async save took the last of it): the metrics row's write is one line naming
    the intact checkpoint and exit 1, no traceback; with space freed the same command resumes, each step once."""
    from moe_tune.metrics import MetricsWriter

    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=6", "checkpoint.every=2", "train.log_every=2", *FAST_RUN]
    log = MetricsWriter.log

    def full_at_step_4(self, row):
        if row["step"] == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        log(self, row)

    monkeypatch.setattr(MetricsWriter, "log", full_at_step_4)
    r = run_main(args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "no space left" in line]
    assert len(lines) == 1 and lines[0].startswith(f"moe-tune: error: writing {run} failed: no space left"), lines
    assert f"{_ckpt(run, 2)} is intact (checkpoint.resume=auto continues from it)" in lines[0], lines
    monkeypatch.undo()
    r = run_main(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 7))


def _full_disk(how: str):
    """A ``save_safetensors`` that fails as a full disk does: an OSError, or safetensors' own error naming it."""
    from safetensors import SafetensorError

    def write(tensors, path):
        if how == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return write


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_disk_full_during_the_runs_export_is_one_line_and_a_rerun_exports(tmp_path, monkeypatch, how):
    from moe_tune.models import export

    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=2", "checkpoint.every=2", *FAST_RUN]
    monkeypatch.setattr(export, "save_safetensors", _full_disk(how))
    r = run_main(args)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "exporting to" in line]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    step_2 = _ckpt(run, 2)
    assert f"exporting to {run / 'hf'} failed: no space left on device (" in lines[0]
    assert f"checkpoints are intact (newest: {step_2})" in lines[0] and "run the same command again" in lines[0]
    assert f"moe-tune-export {step_2} {run / 'hf'}" in lines[0]
    assert not (run / ".hf.partial").exists() and not (run / "hf").exists() and not (run / "summary.json").exists()
    monkeypatch.undo()  # space freed: the same command resumes at train.steps and exports
    r = run_main(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "hf" / "model.safetensors").is_file() and (run / "summary.json").is_file()


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_disk_full_during_moe_tune_export_is_one_line(four_steps, monkeypatch, capsys, how):
    from moe_tune.cli.export import main
    from moe_tune.models import export

    monkeypatch.setattr(export, "save_safetensors", _full_disk(how))
    out = four_steps / "exported"
    with pytest.raises(SystemExit) as e:
        main([_ckpt(four_steps, 4), str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"moe-tune-export: error: exporting to {out} failed: no space left on device (")
    assert f"the checkpoint {_ckpt(four_steps, 4)} is intact" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (four_steps / ".exported.partial").exists() and not out.exists()


@pytest.mark.parametrize("where", ["lock", "base_model"])
def test_disk_full_while_the_run_is_built_is_one_line_and_a_rerun_trains(tmp_path, monkeypatch, where):
    """A restart on a disk still full (the first write is the lock's holder line; a fresh run's is base_model/, which
    safetensors reports as a SafetensorError naming os error 28): one line and exit 1, no traceback, no partial
    base_model.tmp left holding space; with space freed the same command trains."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    from moe_tune.train import lock

    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=2", "checkpoint.every=2", *FAST_RUN]
    if where == "lock":

        def full(fd, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(lock, "_write", full)
    else:
        save = PreTrainedModel.save_pretrained

        def full(self, path, *a, **kw):
            save(self, path, *a, **kw)  # part of it written, then the disk is full
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    r = run_main(args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "no space left" in line]
    assert len(lines) == 1 and lines[0].startswith(f"moe-tune: error: writing {run} failed: no space left"), lines
    assert "no checkpoint was saved" in lines[0], lines
    assert not (run / "base_model.tmp").exists() and not (run / "base_model").exists()
    monkeypatch.undo()
    r = run_main(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run)] == [1, 2]


def test_disk_full_writing_tensorboard_events_is_one_line_without_the_writer_threads_traceback(tmp_path, monkeypatch):
    """TensorBoard writes its events on a thread of its own: a full disk there ended that thread with its traceback
    printed beside the run's one line (interleaved with it). The error is raised again at the logger's next call,
    where it is the one line and exit 1; with space freed the same command resumes, each step once."""
    import threading

    from tensorboard.summary.writer.record_writer import RecordWriter

    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=6", "checkpoint.every=2", "train.log_every=2", "logger=tensorboard"]
    write, calls = RecordWriter.write, []

    def full_after_some_events(self, data):
        calls.append(1)
        if len(calls) > 40:  # past the first steps' scalars
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data)

    monkeypatch.setattr(RecordWriter, "write", full_after_some_events)
    printed = []  # what threading's hook would print (pytest's own hook turns it into a warning instead)
    monkeypatch.setattr(threading, "excepthook", lambda hook_args: printed.append(hook_args.thread.name))
    r = run_main([*args, *FAST_RUN])
    assert r.returncode == 1, r.stderr[-3000:]
    assert not printed and "Traceback" not in r.stderr, (printed, r.stderr[-3000:])
    lines = [line for line in r.stderr.splitlines() if "no space left" in line]
    assert len(lines) == 1 and lines[0].startswith(f"moe-tune: error: writing {run} failed: no space left"), lines
    monkeypatch.undo()
    r = run_main([*args, *FAST_RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 7))


def test_a_failed_background_save_stops_the_run_at_the_next_sync_step(tmp_path, make_trainer, monkeypatch):  # noqa: F811
    """A background save whose write fails raises at the next step that syncs (here every step), not at the next
    save: the steps trained in between could never be saved. Without the check it surfaced at step 12's save."""
    import importlib

    save_module = importlib.import_module("moe_tune.checkpoint.save")  # the package's ``save`` is the function
    write = save_module._write

    def fails_at_step_6(tensors, meta, path, step, *rest):
        if step == 6:
            raise OSError(errno.EIO, "Input/output error", path)
        return write(tensors, meta, path, step, *rest)

    monkeypatch.setattr(save_module, "_write", fails_at_step_6)
    trainer = make_trainer("train.steps=12", "checkpoint.every=6", "train.log_every=1", out=str(tmp_path))
    assert trainer.cfg.checkpoint.async_save
    with pytest.raises(OSError, match="Input/output error"):
        trainer.fit()
    assert 6 < trainer.step < 12, trainer.step
    assert latest(str(tmp_path)) is None  # step 6's save kept nothing that could look complete
