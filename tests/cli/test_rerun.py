"""A run into an output_dir that already holds one (issue 18, item 5): without a checkpoint it is refused (one line,
exit 2, nothing changed) unless ``checkpoint.resume=none`` asks to start afresh over it; a resume says where it
resumes from; every run ends with one line naming its outputs."""

import json

from tests.harness import FAST_RUN, read_metrics, run_main


def _steps(run_dir) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


def _ok(args: list[str]):
    r = run_main(args)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def test_rerun_is_refused_overwritten_on_request_or_resumed(tmp_path):
    run = tmp_path / "run"
    base = [f"output_dir={run}", "checkpoint.export_hf=false", *FAST_RUN]
    r = _ok([*base, "train.steps=2"])
    assert [line.split("] ", 1)[-1] for line in r.stderr.splitlines() if "outputs in" in line] == [f"outputs in {run}"]

    r = run_main([*base, "train.steps=3"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"moe-tune: error: output_dir {run} already holds a run (metrics.jsonl, summary.json)")
    assert "checkpoint.resume=none" in r.stderr
    assert _steps(run) == [1, 2]  # untouched, not appended to

    _ok([*base, "train.steps=2", "checkpoint.resume=none", "checkpoint.every=2"])
    assert _steps(run) == [1, 2]  # started afresh: metrics.jsonl rewritten, not [1, 2, 1, 2]

    r = _ok([*base, "train.steps=3"])
    resumed = [line.split("] ", 1)[-1] for line in r.stderr.splitlines() if "resuming" in line]
    assert resumed == [
        f"resuming from {run / 'checkpoints' / 'step_2'}",
        "resuming with this run's train.steps 2 -> 3 (the checkpoint had the former)",  # a longer schedule
    ], r.stderr[-2000:]
    assert _steps(run) == [1, 2, 3]


def test_a_run_that_stopped_before_its_first_checkpoint_starts_again(tmp_path):
    """A run killed (OOM, a failed node) before any checkpoint leaves metrics.jsonl but no summary.json: the same
    command, as a requeued job gives it, starts again from step 1 with a warning, its rows replaced: it is no
    finished run to protect."""
    import shutil

    run = tmp_path / "run"
    args = [f"output_dir={run}", *FAST_RUN, "train.steps=2"]
    _ok(args)
    (run / "summary.json").unlink()  # what a kill -9 before the end leaves: no summary, no export
    shutil.rmtree(run / "hf")
    r = _ok(args)
    assert f"output_dir {run} holds a run that stopped before its first checkpoint" in r.stderr, r.stderr[-2000:]
    assert _steps(run) == [1, 2]  # replaced, not appended to
    assert (run / "summary.json").is_file()


def test_a_run_finished_after_its_newest_checkpoint_is_not_trained_again(tmp_path):
    """A run whose newest checkpoint is before the step it finished at (saved every 2 steps, finished at 3; or
    stopped on a signal and resumed to its end): the same command again, as a requeued job gives it, trains nothing
    and leaves every output as it was, exit 0; a longer train.steps would resume from that checkpoint and train
    step 3 again over the finished run's outputs: refused, one line, exit 2; resuming from that checkpoint by name
    still trains on purpose."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "checkpoint.export_hf=false", *FAST_RUN, "train.steps=3", "checkpoint.every=2"]
    _ok(args)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_2"] and _steps(run) == [1, 2, 3]
    summary = (run / "summary.json").read_bytes()
    r = _ok(args)
    said = f"output_dir {run} holds a run that finished at train.steps=3 (summary.json): nothing to train"
    assert said in r.stderr and "resuming" not in r.stderr, r.stderr[-2000:]
    assert _steps(run) == [1, 2, 3] and (run / "summary.json").read_bytes() == summary
    r = run_main([*args[:-2], "train.steps=4", "checkpoint.every=2"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(
        f"moe-tune: error: output_dir {run} holds a run that ended at step 3 (summary.json), after its newest "
        "checkpoint step_2: resuming would train step 3 again"
    ), r.stderr
    assert _steps(run) == [1, 2, 3] and (run / "summary.json").read_bytes() == summary
    _ok([*args, f"checkpoint.resume={run / 'checkpoints' / 'step_2'}"])
    assert _steps(run) == [1, 2, 3]


def test_a_copied_finished_run_is_still_finished(tmp_path):
    """``cp -r`` gives every file a new modification time, in the order it copies them: the checkpoint's COMPLETE
    newer than summary.json, which the start took for an earlier run's summary, so a longer train.steps resumed
    from step_2 and trained step 3 again over the copy's outputs."""
    import os
    import shutil
    import time

    run, copy = tmp_path / "run", tmp_path / "copy"
    args = ["checkpoint.export_hf=false", *FAST_RUN, "checkpoint.every=2"]
    _ok([f"output_dir={run}", *args, "train.steps=3"])
    shutil.copytree(run, copy)
    later = time.time() + 60
    os.utime(copy / "checkpoints" / "step_2" / "COMPLETE", (later, later))
    r = run_main([f"output_dir={copy}", *args, "train.steps=4"])
    assert r.returncode == 2 and "holds a run that ended at step 3 (summary.json)" in r.stderr, r.stderr[-2000:]
    assert _steps(copy) == [1, 2, 3]


def test_a_finished_run_without_checkpoints_run_again_trains_nothing(tmp_path):
    """checkpoint.every=0 and the same command again (a requeued job whose node failed after the run's end): exit
    0, nothing trained or written; another train.steps is still refused (no checkpoint to resume from)."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "checkpoint.export_hf=false", *FAST_RUN, "train.steps=2"]
    _ok(args)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] is True and summary["final_step"] == 2
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    r = _ok(args)
    assert "holds a run that finished at train.steps=2 (summary.json): nothing to train" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_run_stopped_for_nonfinite_steps_resumes_with_the_same_command(tmp_path, monkeypatch):
    """A run stopped for too many non-finite steps (exit 1) writes a summary that is no finished run's, and its
    line says to resume with ``checkpoint.resume=auto``: the same command (the cause gone: a lower train.lr, a
    fixed batch) resumes from the newest checkpoint before the stop, or with none starts again from step 1, each
    step's metrics row once. It was refused as a run that ended after its newest checkpoint (or as a run with no
    checkpoint to resume from)."""
    from moe_tune.train.trainer import Trainer

    train_step = Trainer.train_step

    def nonfinite_from_step_3(self, i):
        if i == 2:  # steps 3 on (1-based): every gradient NaN, as an overflow makes them
            self.model.moe_layers()[0].register_forward_hook(lambda module, args, out: out * float("nan"))
        return train_step(self, i)

    for every, resumed_at in ((2, "step_2"), (0, None)):
        run = tmp_path / f"every_{every}"
        args = [f"output_dir={run}", "checkpoint.export_hf=false", *FAST_RUN, "train.steps=6"]
        args += [f"checkpoint.every={every}", "train.log_every=1", "train.max_nonfinite_steps=1"]
        monkeypatch.setattr(Trainer, "train_step", nonfinite_from_step_3)
        r = run_main(args)
        assert r.returncode == 1 and "resume with checkpoint.resume=auto" in r.stderr, r.stderr[-2000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["finished"] is False and summary["final_step"] == 4, summary
        monkeypatch.undo()
        r = _ok(args)
        if resumed_at:
            assert f"resuming from {run / 'checkpoints' / resumed_at}" in r.stderr, r.stderr[-2000:]
        else:
            assert "stopped before its first checkpoint" in r.stderr, r.stderr[-2000:]
        assert _steps(run) == list(range(1, 7))
        assert json.loads((run / "summary.json").read_text())["finished"] is True
