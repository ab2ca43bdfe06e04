"""The ``moe-tune`` command: the default run end to end (the files docs/checkpoints-and-outputs.md lists), under
torchrun with 2 ranks, bad input as one line with exit 2 (before and after the process group exists), and Hydra's
multirun."""

import importlib.metadata
import json
import os
import subprocess

import pytest
import torch

from moe_tune.cli.export import main as export_main
from tests.harness import FAST_RUN, PY, ROOT, assert_hf_logits_equal, read_metrics, run_cli, run_main

CONTRACT_METRICS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "peak_mem_gib",
}
CONTRACT_SUMMARY = {
    "config",
    "versions",
    "hardware",
    "commit",
    "final_loss",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "peak_mem_gib",
}


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path, cli_env):
    """`moe-tune` with no overrides but the run directory: loss falls, files as docs/checkpoints-and-outputs.md lists
    them, hf/ loads."""
    commits = {_git_head()}
    run_cli([f"output_dir={tmp_path}"], cli_env)
    commits.add(_git_head())  # other commits may land while it runs
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 61)) and all(CONTRACT_METRICS <= set(r) for r in rows)
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert CONTRACT_SUMMARY <= set(summary)
    # The values, not only the keys: this run's config, versions, commit and rows.
    with open(tmp_path / "config.json") as f:
        assert summary["config"] == json.load(f)
    assert summary["config"]["model"]["name"] == "tiny_qwen3_moe"
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["versions"]["moe_tune"] == importlib.metadata.version("moe_tune")  # what ran, from a wheel too
    assert summary["commit"] in commits, (summary["commit"], commits)
    assert summary["hardware"].startswith("cpu (") and summary["hardware"].endswith("x 1 processes")
    assert summary["final_loss"] == rows[-1]["loss"]
    tps = sorted(r["tokens_per_s_per_gpu"] for r in rows)
    assert 0 < tps[0] <= summary["tokens_per_s_per_gpu"] <= tps[-1]  # a median of the rows
    for r in rows:
        # TFLOP/s per GPU = FLOPs per token x row positions/s per GPU, padding included (metrics.py): real tokens/s
        # over the row fill
        positions_per_s = r["tokens_per_s_per_gpu"] / r["row_fill"]
        assert r["tflops_per_gpu"] == pytest.approx(summary["flops_per_token"] * positions_per_s / 1e12)
        assert r["lr"] > 0 and r["grad_norm"] > 0
    assert_hf_logits_equal(str(tmp_path / "hf"))


def _git_head() -> str:
    if os.environ.get("MOE_TUNE_COMMIT"):
        return os.environ["MOE_TUNE_COMMIT"]
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.dist
def test_two_rank_torchrun_gloo(tmp_path, cli_env):
    """The default job under torchrun with 2 ranks (FSDP2 on gloo, then EP=2, then parallel.ep=auto, planned in
    each rank's process before its process group): one run directory, rank 0 writes. (The first two under the rank
    harness, in the fast lane: tests/train/test_runs.py::test_ep2_trains_as_fsdp_on_two_ranks.)"""
    r = run_cli([f"output_dir={tmp_path / 'dp'}", "train.steps=4", *FAST_RUN], cli_env, nproc=2)
    assert r.stderr.count(f"[rank0] outputs in {tmp_path / 'dp'}") == 1 and "[rank1] outputs" not in r.stderr
    run_cli([f"output_dir={tmp_path / 'ep'}", "train.steps=4", "parallel.ep=2", *FAST_RUN], cli_env, nproc=2)
    r = run_cli([f"output_dir={tmp_path / 'auto'}", "train.steps=4", "parallel.ep=auto", *FAST_RUN], cli_env, nproc=2)
    assert r.stderr.count("moe-tune: auto: parallel.ep=") == 1
    dp, ep, auto = (read_metrics(tmp_path / run) for run in ("dp", "ep", "auto"))
    assert [r["step"] for r in dp] == [1, 2, 3, 4] == [r["step"] for r in ep] == [r["step"] for r in auto]
    # Same data, same weights: expert parallelism changes where experts run, not the maths.
    for a, b, c in zip(dp, ep, auto):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["loss"] - c["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], c["loss"])
    assert_hf_logits_equal(str(tmp_path / "ep" / "hf"))


BAD_FAMILY = ["model.family=mixtral", "train.steps=2", *FAST_RUN]
BAD_FAMILY_LINE = "moe-tune: error: model.family=mixtral but the checkpoint's model_type is qwen3_moe"


@pytest.mark.dist
@pytest.mark.slow
def test_bad_value_found_after_the_process_group_exists(tmp_path, cli_env):
    """model.family disagrees with the checkpoint: known only once the model config is read, after every rank
    joined the process group. Rank 0 exits 2 with the one line, no traceback; torchrun then fails the job, and
    nothing hangs. Rank 1 finds it too and waits, as before the group: the line is printed once (it was twice)."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_tune"]
    r = subprocess.run(
        cmd + [f"output_dir={tmp_path}", *BAD_FAMILY], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode != 0
    assert r.stderr.count(BAD_FAMILY_LINE) == 1, r.stderr[-3000:]
    # torchrun's root cause (the first rank to exit) is our exit code, not a crash or its own SIGTERM.
    root_cause = r.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 0 " in root_cause and "exitcode  : 2 " in root_cause, r.stderr[-3000:]
    # The message is never an exception rendered by Python: no frame of moe_tune's code, no exception line.
    frames = [line for line in r.stderr.splitlines() if line.lstrip().startswith('File "') and "moe_tune" in line]
    assert not frames, r.stderr[-3000:]
    assert all(line.startswith("moe-tune: error: ") for line in r.stderr.splitlines() if "model.family=mixtral" in line)
    # Found after the process group existed: rank 0 had built the base model before the ranks' barrier (and
    # leaves it: rank 1 may be reading it).
    assert (tmp_path / "base_model" / "config.json").exists()
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "existing, own_model", [(False, False), (True, False), (True, True)], ids=["new_dir", "existing_dir", "model_hf"]
)
def test_a_value_found_bad_once_the_model_is_known_leaves_output_dir_as_it_was(
    tmp_path, tiny_checkpoint, existing, own_model
):
    """peft.target is checked against the model's linears, after the run took its lock and built its base
    model: one line, exit 2, and output_dir as the command found it (a new one gone, an existing one's files
    kept, nothing added)."""
    out = tmp_path / "run"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    model = ["model=hf", f"model.path={tiny_checkpoint()}"] if own_model else []  # builds no base_model/
    args = [f"output_dir={out}", *model, "peft=lora", "peft.target=[qproj]", "train.steps=1"]
    line = _one_error_line(args)
    assert "peft.target names 'qproj', which is no linear of this model" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] if existing else not out.exists()


def test_bad_value_after_the_process_group_exists_tears_it_down(tmp_path, monkeypatch, capsys):
    """In process (one rank): the group was created before the value was found bad, and the CLI destroys it
    before exiting 2 (with NCCL, an exit without destroy_process_group() warns and can hang)."""
    import torch.distributed as dist

    from moe_tune.cli.train import compose, run
    from moe_tune.distributed.process_group import destroy_distributed

    destroy_distributed()  # a group left over from an earlier in-process test
    created = []
    init_process_group = dist.init_process_group

    def spy(*args, **kwargs):
        created.append(kwargs.get("world_size"))
        return init_process_group(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    with pytest.raises(SystemExit) as e:
        run(compose([f"output_dir={tmp_path}", *BAD_FAMILY]))
    assert e.value.code == 2
    assert created == [1]  # the group existed when the error was found
    assert not dist.is_initialized()  # and it is gone
    assert capsys.readouterr().err.count(BAD_FAMILY_LINE) == 1


def test_a_waiting_rank_that_is_not_stopped_prints_its_line(monkeypatch, capsys):
    """A rank that leaves the line to its node's first rank still prints it when that rank did not fail (the
    error was its own): the line is late, never lost."""
    from moe_tune.cli import train as cli

    monkeypatch.setattr(cli, "QUIET_EXIT_DELAY_S", 0.0)
    with pytest.raises(SystemExit) as e:
        cli.fail("data.jsonl:2: not valid JSON", quiet=True)
    assert e.value.code == 2
    assert capsys.readouterr().err == "moe-tune: error: data.jsonl:2: not valid JSON\n"


@pytest.mark.parametrize("local_rank, says", [("0", True), ("1", False)])
def test_a_stop_while_starting_is_said_by_the_nodes_first_rank(monkeypatch, capsys, kept_signals, local_rank, says):
    """torchrun passes a signal to every rank: a stop before training is one line from the node's first rank (each
    rank said it, eight lines on a node of eight), and every rank exits 128 + the signal."""
    import signal

    from moe_tune.cli import train as cli

    for key, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert cli.interrupted(cli.StopRequested(signal.SIGTERM)) == 143
    line = "moe-tune: stopped by signal 15; nothing saved since the last checkpoint\n"
    assert capsys.readouterr().err == (line if says else "")


def test_a_hang_up_while_starting_is_a_stop_unless_ignored(kept_signals):
    """SIGHUP before training (the terminal gone) is one line and exit 129, as SIGTERM is; nohup's ignored SIGHUP
    stays ignored, and is left so when the run is over."""
    import os
    import signal

    from moe_tune.cli import train as cli

    cli.honour_sigint()
    assert signal.getsignal(signal.SIGHUP) == cli._stop_requested  # not the default, which kills the process
    with pytest.raises(cli.StopRequested) as stop:
        os.kill(os.getpid(), signal.SIGHUP)
    assert stop.value.signum == signal.SIGHUP
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    cli.honour_sigint()
    os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing raised
    cli.restore_default_signals()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_a_quit_while_starting_is_a_stop_unless_ignored(kept_signals):
    """SIGQUIT before training (Ctrl-\\, or torchrun's agent passing it on) is one line and exit 131, as SIGTERM is,
    not the default's core dump; a SIGQUIT inherited ignored (a job a script starts with &) stays ignored, and is
    left so when the run is over."""
    import os
    import signal

    from moe_tune.cli import train as cli

    cli.honour_sigint()
    assert signal.getsignal(signal.SIGQUIT) == cli._stop_requested
    with pytest.raises(cli.StopRequested) as stop:
        os.kill(os.getpid(), signal.SIGQUIT)
    assert stop.value.signum == signal.SIGQUIT and cli.interrupted(stop.value) == 131
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    cli.honour_sigint()
    os.kill(os.getpid(), signal.SIGQUIT)  # ignored: nothing raised
    cli.restore_default_signals()
    assert signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN


def test_a_repeated_stop_signal_does_not_cut_the_stops_line(kept_signals, capsys):
    """scancel retries its signal: a second SIGTERM while the first stop's line was said (the launcher importing
    what it needs for it) raised StopRequested inside the handling, a traceback and exit 1 in place of 143."""
    import os
    import signal

    from moe_tune.cli import train as cli

    cli.honour_sigint()
    assert cli.interrupted(cli.StopRequested(signal.SIGTERM)) == 143
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the repeat: ignored, not raised
    except KeyboardInterrupt as e:
        pytest.fail(f"the repeated SIGTERM raised {e!r}")
    assert capsys.readouterr().err == "moe-tune: stopped by signal 15; nothing saved since the last checkpoint\n"


def test_a_waiting_rank_stopped_by_torchrun_says_nothing(cli_env):
    """A rank that leaves the error's line to its node's first rank, then gets torchrun's SIGTERM while it waits:
    it ends by the signal without a line, so the user reads the error's line alone."""
    import signal

    script = (  # says "waiting" once fail() waits, so the signal lands in the wait
        "import time\n"
        "from moe_tune.cli import train\n"
        "wait = time.sleep\n"
        "time.sleep = lambda s: (print('waiting', flush=True), wait(s))\n"
        "train.honour_sigint()\n"
        "train.fail('parallel.ep (3) must divide the world size (2)', quiet=True)\n"
    )
    env = {**cli_env, "TORCHELASTIC_RUN_ID": "none"}  # as torchrun's agent starts its ranks
    p = subprocess.Popen([PY, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "waiting\n"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (-signal.SIGTERM, ""), err[-2000:]


LEAVE_MIDWAY = """
import logging, sys, threading, time
from moe_tune.cli import train
from moe_tune.distributed.process_group import init_distributed
init_distributed("gloo")
threading.Thread(target=time.sleep, args=(120,), name="a checkpoint writer").start()
logging.basicConfig(stream=sys.stdout)
logging.getLogger("moe_tune").warning("logged before the stop")
print("printed before the stop", file=sys.stderr)
train.leave(130)
"""


def test_a_stop_that_leaves_the_run_midway_exits_at_once_with_its_code(cli_env):
    """A second Ctrl-C while a checkpoint writer runs and a process group exists: exit 130 now, logs flushed; not
    after the writer, and not through the interpreter's teardown of the group's threads."""
    r = subprocess.run([PY, "-c", LEAVE_MIDWAY], env=cli_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130, r.stderr[-2000:]
    assert "logged before the stop" in r.stdout and r.stderr.strip() == "printed before the stop"


@pytest.mark.parametrize(
    "args,message",
    [
        (["model.bogus=1"], "model.bogus is not a config key"),
        (["parallel.ep=x"], "parallel.ep"),
        (["comm=nccl_magic"], "comm"),
        (["parallel.ep=3"], "parallel.ep (3) must divide"),
        (["model.path=/nonexistent"], "model.path=/nonexistent does not exist; moe_tune reads local checkpoints only"),
        (["kernels=te"], "TransformerEngine is not installed"),
        (["model.family=mixtral"], "model.family=mixtral but the checkpoint's model_type is qwen3_moe"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, message, tmp_path):
    assert message in _one_error_line([f"output_dir={tmp_path}", *args])


@pytest.mark.dist
@pytest.mark.slow
def test_bad_value_under_two_ranks_is_one_line(tmp_path, cli_env):
    """A value found bad before any process group exists: only the node's first rank prints the line (each rank
    found the same error in the same command line), and it is torchrun's root cause: the quiet rank exits after
    it, so torchrun cannot stop the printing rank first."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_tune"]
    out = tmp_path / "run"
    r = subprocess.run(cmd + [f"output_dir={out}", "train.lr=-1"], capture_output=True, text=True, env=cli_env)
    assert r.stderr.count("moe-tune: error: train.lr=-1.0 is out of range") == 1, r.stderr[-3000:]
    root_cause = r.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 0 " in root_cause and "exitcode  : 2 " in root_cause, r.stderr[-3000:]
    assert not out.exists()


def _one_error_line(args: list[str], env=None, cwd=None) -> str:
    """``moe-tune args`` exits 2 with exactly one non-empty stderr line (no traceback): that line. In this process
    (harness.run_main); with ``env``, in a subprocess with that environment."""
    if env is None:
        r = run_main(args, cwd=cwd)
    else:
        cmd = [PY, "-m", "moe_tune", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=cwd)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["data=jsonl", "data.path=/nonexistent/chat.jsonl"], "data.path=/nonexistent/chat.jsonl does not exist"),
        (["checkpoint.resume=/nonexistent/step_5"], "checkpoint.resume=/nonexistent/step_5 does not exist"),
    ],
)
def test_cli_missing_input_path_exits_2_before_output_dir_exists(args, message, tmp_path):
    run_dir = tmp_path / "run"
    assert message in _one_error_line([f"output_dir={run_dir}", *args])
    assert not run_dir.exists()  # no lock, no base model, no config written


def test_cli_missing_val_path_names_data_val_path(tmp_path):
    """A wrong data.val_path next to a good data.path was reported as ``data.path=<it> does not exist``."""
    (tmp_path / "train.jsonl").write_text('{"text": "a record"}\n')
    args = [f"output_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'train.jsonl'}", "data.val_path=nonexist.jsonl"]
    assert _one_error_line(args, cwd=tmp_path).startswith(
        "moe-tune: error: data.val_path=nonexist.jsonl does not exist; give a file"
    )


@pytest.mark.slow
def test_cli_hub_dataset_offline_is_one_line_at_once(cli_env, tmp_path):
    """A hub dataset name with HF_HUB_OFFLINE=1 and no copy in the datasets cache: the line, not datasets' retries."""
    run_dir = tmp_path / "run"
    env = {**cli_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    line = _one_error_line([f"output_dir={run_dir}", "data.path=someone/some-dataset"], env)
    assert "someone/some-dataset is not a local file or directory nor in the datasets cache, and the hub is out" in line
    assert line.endswith("or unset HF_HUB_OFFLINE")
    assert not run_dir.exists()


def test_cli_malformed_record_exits_2_before_output_dir_exists(tmp_path):
    """A bad JSONL line (data.on_bad_record=error, the default) is found before the run's lock or a preset's
    base_model/ is written: one line naming file:line and the fix, exit 2, no output_dir."""
    data = tmp_path / "chat.jsonl"
    good = '{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}'
    data.write_text(good + "\n" + '{"messages": [' + "\n")
    run_dir = tmp_path / "run"
    line = _one_error_line([f"output_dir={run_dir}", "data=jsonl", f"data.path={data}", "train.seq_len=64"])
    # file:line once: json's own "line 2 column 1 (char 15)" (it counted the line's newline) read as another line
    assert line == (
        f"moe-tune: error: {data}:2: not valid JSON (Expecting value at column 15); fix the line or set "
        "data.on_bad_record=skip"
    )
    assert not run_dir.exists()  # no lock, no base model, no config written


def test_cli_hub_id_as_model_path_says_it_is_not_downloaded(tmp_path):
    """``model.path=Qwen/Qwen3-30B-A3B``: not "no config.json" in a directory named after the cwd, but that moe_tune
    reads local checkpoints only and how to get one."""
    line = _one_error_line([f"output_dir={tmp_path / 'run'}", "model.path=Qwen/Qwen3-30B-A3B"], cwd=tmp_path)
    assert line == (
        f"moe-tune: error: model.path=Qwen/Qwen3-30B-A3B does not exist (no directory {tmp_path}/Qwen/Qwen3-30B-A3B); "
        "moe_tune reads local checkpoints only and downloads nothing from the Hugging Face hub: download it first "
        "(hf download Qwen/Qwen3-30B-A3B --local-dir <dir>), then give model.path=<dir>"
    )
    assert not (tmp_path / "run").exists()


def test_cli_lora_export_as_model_path_names_its_base_and_the_merge(tmp_path):
    """A LoRA run's hf/ (a PEFT adapter) as model.path: the line names the base model and the run's checkpoint to
    merge; the merge it names gives a directory model.path takes. The run's output_dir is relative and the merge
    runs elsewhere: the built-in preset's base model is named by its absolute path."""
    from moe_tune.config.model_dir import model_dir_problem

    run = tmp_path / "lora"
    args = ["output_dir=lora", "peft=lora", "train.steps=2", "checkpoint.every=2", *FAST_RUN]
    assert run_main(args, cwd=tmp_path).returncode == 0
    line = _one_error_line([f"output_dir={tmp_path / 'next'}", f"model.path={run / 'hf'}"])
    assert line.startswith(f"moe-tune: error: model.path={run / 'hf'} is a PEFT LoRA adapter (adapter_config.json, ")
    assert f"its base model is {run / 'base_model'} (adapter_config.json's base_model_name_or_path): " in line
    assert f"give model.path={run / 'base_model'}, or merge the adapter into its base first (moe-tune-export " in line
    checkpoint = run / "checkpoints" / "step_2"
    assert f"{checkpoint} <dir> --merge, or PEFT's merge_and_unload) and give model.path=<dir>" in line
    merged = tmp_path / "merged"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_main([str(checkpoint), str(merged), "--merge"], cwd=elsewhere, main=export_main)
    assert r.returncode == 0, r.stderr[-3000:]
    assert model_dir_problem(str(merged)) is None


def test_cli_unsupported_architecture_exits_2(tmp_path, tiny_checkpoint):
    """A dense (Llama) checkpoint: one line naming it and the supported families, exit 2."""
    from moe_tune.models.presets import build_tokenizer

    llama = tiny_checkpoint("llama")
    build_tokenizer(llama)
    line = _one_error_line([f"output_dir={tmp_path / 'run'}", "model=hf", f"model.path={llama}"])
    assert "model_type 'llama' (LlamaForCausalLM) is not a supported MoE family" in line and "qwen3_moe" in line
    assert not (tmp_path / "run").exists()  # found from config.json, before the run takes its lock


def test_a_checkpoint_given_to_a_preset_of_another_family_names_model_hf(tmp_path, tiny_checkpoint):
    """model.path with a preset chosen (tiny_qwen3_moe) and an OLMoE checkpoint: the fix is model=hf (the preset's
    family is not the user's), said before anything is written. model.path alone chooses model=hf itself."""
    olmoe = tiny_checkpoint("olmoe")
    line = _one_error_line([f"output_dir={tmp_path / 'run'}", "model=tiny_qwen3_moe", f"model.path={olmoe}"])
    assert f"load your checkpoint with model=hf model.path={olmoe}" in line and "model_type olmoe" in line
    assert not (tmp_path / "run").exists()


def test_a_config_json_its_weights_contradict_is_refused_before_the_run(tmp_path, tiny_checkpoint):
    """config.json edited to 16 experts beside weights of 8 (both keys there, transformers reading the other one):
    the run says what moe-tune-plan says, one line and exit 2 before anything is written, where it trained a model
    of 8 experts and exported a config.json of 16."""
    path = tiny_checkpoint("qwen3_moe")
    config = json.loads(open(f"{path}/config.json").read())
    open(f"{path}/config.json", "w").write(json.dumps({**config, "num_experts": 16}))
    line = _one_error_line([f"output_dir={tmp_path / 'run'}", "model=hf", f"model.path={path}"])
    assert f"{path}/config.json: num_experts=16 but the safetensors weights beside it hold 8" in line, line
    assert "set num_experts=8 there" in line and not (tmp_path / "run").exists()


def test_checkpoint_resume_naming_a_run_or_its_checkpoints_folder_names_the_checkpoint(tmp_path):
    """checkpoint.resume=<a run directory> or <its checkpoints/ folder> is refused before the data is read or
    anything written, naming its newest checkpoint; an interrupted save (no COMPLETE) too."""
    run, new = tmp_path / "run", tmp_path / "new"
    r = run_main([f"output_dir={run}", "train.steps=2", "checkpoint.every=1", "checkpoint.export_hf=false", *FAST_RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    newest = run / "checkpoints" / "step_2"
    for given, what in ((run, "is a run directory"), (run / "checkpoints", "is a run's checkpoints folder")):
        line = _one_error_line([f"output_dir={new}", f"checkpoint.resume={given}", *FAST_RUN])
        assert f"checkpoint.resume={given} is not a complete checkpoint" in line, line
        assert f"{given} {what}: give one of its checkpoints, e.g. {newest}" in line, line
        assert not new.exists()
    (newest / "COMPLETE").unlink()  # as a save killed before its end leaves it
    line = _one_error_line([f"output_dir={new}", f"checkpoint.resume={newest}", *FAST_RUN])
    assert line.endswith(f"checkpoint.resume={newest} is not a complete checkpoint (no COMPLETE file)"), line


def test_hydra_multirun_gives_each_job_its_own_run_directory(tmp_path):
    """`moe-tune -m a=1,2`: Hydra's sweep (the same path the submitit_slurm launcher takes) runs both jobs."""
    args = ["-m", f"output_dir={tmp_path}", "train.lr=1e-3,2e-3", "train.steps=2", "checkpoint.export_hf=false"]
    r = run_main([*args, *FAST_RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        rows = read_metrics(tmp_path / "multirun" / job)
        assert [row["step"] for row in rows] == [1, 2], r.stdout
    lrs = [json.load(open(tmp_path / "multirun" / j / "config.json"))["train"]["lr"] for j in ("0", "1")]
    assert lrs == [1e-3, 2e-3]


SIGTERM_AT_EXIT = """
import atexit, os, signal, sys
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # registered first: runs last, in the teardown
sys.argv = ["moe-tune", *sys.argv[1:]]
from moe_tune.cli.train import main
main()
"""


@pytest.mark.slow
def test_a_sigterm_after_the_run_ends_the_process_by_the_signal_without_a_traceback(tmp_path, cli_env):
    """A SIGTERM during the interpreter's teardown, the run finished: the stop handlers are gone by then, so the
    signal ends the process by its default action (-15 here, a shell's 143), no traceback from an atexit callback."""
    import signal

    args = [f"output_dir={tmp_path}", "train.steps=1", "checkpoint.export_hf=false", *FAST_RUN]
    r = subprocess.run([PY, "-c", SIGTERM_AT_EXIT, *args], env=cli_env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == -signal.SIGTERM, r.stderr[-3000:]
    assert (tmp_path / "summary.json").is_file() and f"outputs in {tmp_path}" in r.stderr
