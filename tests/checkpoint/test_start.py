"""What a run's start makes of its output_dir's checkpoints (new-user trial): a checkpoint past train.steps is
refused (one line, exit 2, nothing written), a finished run trains and writes nothing and says so (its checkpoint
at train.steps writes the outputs again when the run stopped before its summary), and a save cut short is named
when resume=auto passes over it."""

from __future__ import annotations

import json
import os

import pytest

from moe_tune.checkpoint import RunFinished
from moe_tune.checkpoint.start import check_start
from moe_tune.config import CheckpointError
from tests.harness import FAST_RUN, read_metrics, run_main


def _ok(args: list[str]):
    r = run_main(args)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _files(run_dir) -> dict[str, float]:
    return {os.path.join(d, n): os.path.getmtime(os.path.join(d, n)) for d, _, names in os.walk(run_dir) for n in names}


def test_a_checkpoint_past_train_steps_is_refused_and_one_at_it_is_a_finished_run(tmp_path):
    run = tmp_path / "x"
    base = [f"output_dir={run}", "checkpoint.every=2", *FAST_RUN]
    _ok([*base, "train.steps=4"])
    before = _files(run)

    r = run_main([*base, "train.steps=2"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr == (
        f"moe-tune: error: output_dir={run}: its checkpoint step_4 is past train.steps=2: nothing to train; raise "
        "train.steps above 4, give a new output_dir, or checkpoint.resume=none to start afresh over it\n"
    )
    named = [*base, "train.steps=3", f"output_dir={tmp_path / 'y'}", f"checkpoint.resume={run}/checkpoints/step_4"]
    r = run_main(named)
    assert r.returncode == 2 and "is at step 4, past train.steps=3: nothing to train" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "y").exists()
    lock = str(run / ".lock")  # the refused run took the lock (its file's time), nothing else
    assert {k: v for k, v in _files(run).items() if k != lock} == {k: v for k, v in before.items() if k != lock}

    r = _ok([*base, "train.steps=4"])  # the same command again: the run is finished, its outputs stand
    assert f"output_dir {run} holds a run that finished at train.steps=4 (summary.json): nothing to train" in r.stderr
    # its checkpoint step_4 is at train.steps, so a longer train.steps resumes from it
    assert "its outputs stand (raise train.steps to train on, or give another output_dir)" in r.stderr
    assert {k: v for k, v in _files(run).items() if k != lock} == {k: v for k, v in before.items() if k != lock}
    (run / "summary.json").unlink()  # as if stopped while writing its outputs: the checkpoint writes them again
    r = _ok([*base, "train.steps=4"])
    assert f"{run}/checkpoints/step_4 is at train.steps=4: the run is finished, nothing to train" in r.stderr
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3, 4] and (run / "summary.json").is_file()


def test_auto_resume_names_the_incomplete_checkpoint_it_passes_over(tmp_path):
    run = tmp_path / "x"
    base = [f"output_dir={run}", "checkpoint.every=2", "checkpoint.export_hf=false", *FAST_RUN]
    _ok([*base, "train.steps=4"])
    os.remove(run / "checkpoints" / "step_4" / "COMPLETE")  # as if killed during the save of step 4,
    os.remove(run / "summary.json")  # which comes before the summary
    r = _ok([*base, "train.steps=4"])
    warned = [line.split("] ", 1)[-1] for line in r.stderr.splitlines() if "incomplete" in line]
    assert warned == [
        f"passing over incomplete checkpoint {run}/checkpoints/step_4 (a save cut short); resuming from "
        f"{run}/checkpoints/step_2"
    ], r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3, 4]


def test_a_finished_run_without_a_checkpoint_at_its_end_does_not_say_raise_train_steps(tmp_path):
    """The default run saves no checkpoint: its rerun's line said 'raise train.steps to train on', and the longer
    run it advised was refused (exit 2: no checkpoint to resume from). The line gives a fix that runs."""
    run = tmp_path / "x"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4}))
    with pytest.raises(RunFinished) as finished:
        check_start(str(run), "auto", 4)
    assert str(finished.value) == (
        f"output_dir {run} holds a run that finished at train.steps=4 (summary.json): nothing to train; its outputs "
        "stand (to train further, give another output_dir: it has no checkpoint at step 4 to go on from)"
    )
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        check_start(str(run), "auto", 5)  # what 'raise train.steps' led to


def test_a_finished_run_of_another_model_is_no_retry_of_it(tmp_path):
    """A finished LoRA run's output_dir given to a full fine-tune, another rank or another base: told 'nothing to
    train; its outputs stand', exit 0, as a retry of the same command is, with no run of the model asked for. Refused
    naming the settings on both sides; the same model (a path spelt otherwise, another quantize_base) is still the
    finished run."""
    from moe_tune.config import Config

    run = tmp_path / "x"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "adapter_config.json").write_text("{}")
    cfg = Config()
    cfg.model.name, cfg.model.path, cfg.peft.name, cfg.peft.rank = "hf", str(tmp_path / "base"), "lora", 8
    config = json.loads(json.dumps({"model": vars(cfg.model), "peft": vars(cfg.peft)}, default=list))
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4, "config": config}))

    def start(**changes):
        now = Config()
        now.model.name, now.model.path, now.peft.name, now.peft.rank = "hf", str(tmp_path / "base"), "lora", 8
        for key, value in changes.items():
            section, _, name = key.partition("__")
            setattr(getattr(now, section), name, value)
        check_start(str(run), "auto", 4, cfg=now)

    for changes, said in [
        ({"peft__name": "none"}, "(that run: peft=lora; this run: peft=none)"),
        ({"peft__rank": 16}, "(that run: peft.rank=8; this run: peft.rank=16)"),
        ({"model__path": str(tmp_path / "other")}, f"(that run: model.path={tmp_path / 'base'}; this run: model.path="),
    ]:
        with pytest.raises(CheckpointError) as e:
            start(**changes)
        assert f"output_dir {run} holds a run that finished at train.steps=4 with other settings {said}" in str(e.value)
        assert "give another output_dir, or checkpoint.resume=none to start afresh over it" in str(e.value)
    for changes in [{}, {"model__path": str(tmp_path / "." / "base")}, {"peft__quantize_base": "nf4"}]:
        with pytest.raises(RunFinished):
            start(**changes)
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4}))  # no config recorded
    with pytest.raises(RunFinished):
        start()


def test_a_finished_run_on_other_data_is_no_retry_of_it(tmp_path):
    """A finished run's output_dir given another data.path (or the same records made into other rows: another
    train.seq_len) was told 'nothing to train; its outputs stand', exit 0: nothing trained on the data asked for.
    Refused naming both sides; the same file through a link is still the finished run."""
    from dataclasses import asdict

    from moe_tune.config import Config

    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    (tmp_path / "latest.jsonl").symlink_to(tmp_path / "a.jsonl")
    run = tmp_path / "x"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    cfg = Config()
    cfg.data.name, cfg.data.path = "jsonl", str(tmp_path / "a.jsonl")
    config = json.loads(json.dumps(asdict(cfg), default=list))
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4, "config": config}))

    def start(path: str, seq_len: int = cfg.train.seq_len):
        now = Config()
        now.data.name, now.data.path, now.train.seq_len = "jsonl", str(tmp_path / path), seq_len
        check_start(str(run), "auto", 4, cfg=now)

    for args, said in [
        (("b.jsonl",), f"(that run: data.path={tmp_path / 'a.jsonl'}; this run: data.path={tmp_path / 'b.jsonl'})"),
        (("a.jsonl", 64), f"(that run: train.seq_len={cfg.train.seq_len}; this run: train.seq_len=64)"),
    ]:
        with pytest.raises(CheckpointError) as e:
            start(*args)
        assert f"holds a run that finished at train.steps=4 with other data {said}: its outputs" in str(e.value)
    for path in ("a.jsonl", "latest.jsonl"):
        with pytest.raises(RunFinished):
            start(path)


def test_a_finished_run_with_other_hyperparameters_is_no_retry_of_it(tmp_path):
    """A sweep run again with its values in another order (``-m train.lr=3e-3,1e-3`` after ``1e-3,3e-3``): job 0,
    lr 3e-3, met multirun/0's lr 1e-3 run and was told 'nothing to train; its outputs stand', exit 0, so its
    results read as another learning rate's. Refused naming both sides; the same values (a retry) still finish."""
    from dataclasses import asdict

    from moe_tune.config import Config

    run = tmp_path / "x"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    config = json.loads(json.dumps(asdict(Config()), default=list))  # betas: a list in JSON
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4, "config": config}))

    def start(lr: float = Config().train.lr, betas: tuple = Config().optim.betas):
        now = Config()
        now.train.lr, now.optim.betas = lr, betas
        check_start(str(run), "auto", 4, cfg=now)

    with pytest.raises(CheckpointError) as e:
        start(lr=1e-2)
    said = f"(that run: train.lr={Config().train.lr}; this run: train.lr=0.01)"
    assert f"holds a run that finished at train.steps=4 with other hyperparameters {said}: its outputs" in str(e.value)
    for betas in (Config().optim.betas, tuple(Config().optim.betas)):
        with pytest.raises(RunFinished):
            start(betas=betas)


@pytest.mark.parametrize("checkpoint", [None, 6], ids=["rows", "rows-and-checkpoint"])
def test_a_finished_run_names_a_longer_run_that_went_on_from_it_and_stopped(tmp_path, checkpoint):
    """A run finished at 4 steps, then train.steps=8 went on from it and was killed at step 6: the 4-step command
    again trains nothing, and the line says what the directory holds past step 4 and how it goes on (it said only
    that the outputs stand, beside metrics rows 5-6 the summary does not know)."""
    run = tmp_path / "x"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"finished": True, "final_step": 4}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"st')
    for step in (4, checkpoint) if checkpoint else (4,):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "COMPLETE").write_text(json.dumps({"step": step}))
    with pytest.raises(RunFinished) as finished:
        check_start(str(run), "auto", 4)
    at = ", its checkpoint at step 6" if checkpoint else ""
    assert f"a longer run went on from it to step 6 and stopped (metrics.jsonl's rows 5-6{at}): a train.steps " in (
        str(finished.value)
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    if not checkpoint:
        with pytest.raises(RunFinished, match=r"its outputs stand \(raise train.steps to train on"):
            check_start(str(run), "auto", 4)
