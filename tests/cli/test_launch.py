"""``python -m moe_tune.launch``: torchrun running moe_tune, exiting with the code a scheduler needs (torchrun
itself exits 1 with its agent's traceback on SIGTERM, and 1 for a rank's exit 2)."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from moe_tune.cli.launch import RANKS_SAID, split_argv
from moe_tune.cli.train import INTERRUPTED
from tests.cli.test_train import BAD_FAMILY, BAD_FAMILY_LINE
from tests.harness import FAST_RUN, PY, run_main, signal_after_rows

LAUNCH = [PY, "-m", "moe_tune.launch", "--standalone", "--nproc-per-node", "2"]


def test_split_argv_at_the_first_override():
    assert split_argv(["--nproc-per-node", "8", "--standalone", "a.b=1", "c=2"]) == (
        ["--nproc-per-node", "8", "--standalone"],
        ["a.b=1", "c=2"],
    )
    assert split_argv(["--nproc-per-node=2", "--rdzv-endpoint=h:1", "x=y"]) == (
        ["--nproc-per-node=2", "--rdzv-endpoint=h:1"],
        ["x=y"],
    )
    assert split_argv(["--standalone"]) == (["--standalone"], [])


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_a_sweep_flag_anywhere_is_moe_tunes(flag):
    """-m is torchrun's module flag too, and the launcher names the module itself: before the overrides it was
    taken as torchrun's (the ranks ran no sweep, and the check said "add -m"), after them it was read as an
    override (Hydra's grammar error)."""
    want = (["--standalone"], [flag, "train.lr=1,2", "c=2"])
    assert split_argv(["--standalone", flag, "train.lr=1,2", "c=2"]) == want
    assert split_argv(["--standalone", "train.lr=1,2", flag, "c=2"]) == want
    assert split_argv([flag, "--standalone"]) == (["--standalone"], [flag])


@pytest.mark.slow
def test_a_sweep_through_the_launcher_runs_each_job(tmp_path, cli_env):
    args = [f"output_dir={tmp_path}", *FAST_RUN, "train.steps=1", "train.lr=1e-3,2e-3", "-m"]
    r = subprocess.run(LAUNCH + args, capture_output=True, text=True, env=cli_env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all((tmp_path / "multirun" / str(job) / "summary.json").exists() for job in (0, 1))


@pytest.mark.parametrize("args", [["-m", "train.steps=2,-1"], ["train.steps=-1,2", "--multirun"]], ids=str)
def test_a_bad_value_of_a_sweep_is_one_line_before_any_rank_starts(tmp_path, args):
    """Every job's values are checked before torchrun starts, as moe-tune checks a sweep's."""
    from moe_tune.cli.launch import main

    out = tmp_path / "run"
    r = run_main([f"output_dir={out}", *args], main=main)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "train.steps=-1 is out of range" in r.stderr and not out.exists()


def test_auto_layout_values_pass_the_launchers_check(capsys):
    """``parallel.ep=auto`` and the other planned keys are each rank's to resolve, for the world size torchrun
    gives it (docs/planning.md): the launcher's check refused them ("parallel.ep='auto' is not an integer"). A bad
    value beside them is still its one line."""
    from moe_tune.cli.launch import check_overrides

    check_overrides(["parallel.ep=auto", "train.micro_batch_size=auto", "parallel.activation_checkpointing=auto"])
    with pytest.raises(SystemExit) as e:
        check_overrides(["parallel.ep=auto", "train.steps=-1"])
    assert e.value.code == 2 and "train.steps=-1 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGQUIT],
    ids=["sigterm", "ctrl_c", "sigusr1", "sigquit"],
)
@pytest.mark.slow
def test_a_stop_signal_exits_128_plus_it_without_a_traceback(tmp_path, cli_env, signum):
    """SIGTERM (Slurm), SIGINT (Ctrl-C in the terminal reaches the launcher, which passes it on), SIGUSR1 (Slurm's
    warning before the time limit; torchrun's agent alone dies of it and leaves the ranks running) or SIGQUIT
    (passed on as SIGINT is; the ranks died of it without saving) to the launcher: both ranks save the agreed step; the launcher exits 128 + the signal with one line."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", "parallel.ep=2", *FAST_RUN]
    code, err = signal_after_rows(LAUNCH + args, cli_env, run, 2, signum)
    assert code == 128 + signum, err[-3000:]
    assert f"moe-tune: stopped by signal {int(signum)}" in err and "Traceback" not in err, err[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]
    # The launcher claims no save of its own: a rank stopped while starting says it saved nothing.
    assert f"moe-tune: stopped by signal {signal.Signals(signum)}; {RANKS_SAID}\n" in err, err[-3000:]


# SIGINT as a child inherits it, whatever pytest's own: a terminal leaves it at its default; a non-interactive shell
# leaves it ignored for a process started with "&" (job control off), and Python keeps an inherited ignore.
INHERITED_SIGINT = {"default": signal.SIG_DFL, "ignored": signal.SIG_IGN}

# Runs the module argv[1] as ``python -m`` would, printing STARTING on stderr when it first imports torch: the run
# has begun checking its inputs, seconds before training.
STARTING = "test: importing torch"
MARK_STARTING = f"""
import runpy, sys

class MarkTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print({STARTING!r}, file=sys.stderr, flush=True)

sys.meta_path.insert(0, MarkTorch())
sys.argv[0] = sys.argv.pop(1)
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def inheriting(inherited: str):
    """Popen's preexec_fn: the child starts with SIGINT ``inherited`` (kept across exec, as a shell leaves it)."""
    return lambda: signal.signal(signal.SIGINT, INHERITED_SIGINT[inherited])


def ctrl_c_while_starting(
    module: str, args: list[str], env: dict, inherited: str, signum: int = signal.SIGINT
) -> tuple[int, list[str]]:
    """``python -m module args`` started with SIGINT ``inherited``, sent ``signum`` once it prints STARTING:
    (exit code, its stderr lines after that one)."""
    cmd = [PY, "-c", MARK_STARTING, module, *args]
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=inheriting(inherited))
    for line in iter(p.stderr.readline, ""):
        if line.rstrip("\n") == STARTING:
            p.send_signal(signum)
            break
    after = p.stderr.read()
    return p.wait(timeout=60), after.splitlines()


@pytest.mark.parametrize("inherited", INHERITED_SIGINT)
@pytest.mark.slow
def test_ctrl_c_in_one_process_saves_and_before_training_is_one_line(tmp_path, cli_env, inherited):
    """moe-tune alone, whether SIGINT was inherited at its default or ignored: Ctrl-C during training stops after
    the next agreed step with a checkpoint (exit 130, no traceback); a Ctrl-C while the run starts is one line,
    exit 130, nothing written."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", *FAST_RUN]
    cmd = [PY, "-m", "moe_tune", *args]
    code, err = signal_after_rows(cmd, cli_env, run, 2, signal.SIGINT, preexec_fn=inheriting(inherited))
    assert code == 130 and "stopped by signal 2 after step" in err and "Traceback" not in err, err[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]
    early = tmp_path / "early"
    code, lines = ctrl_c_while_starting("moe_tune", [f"output_dir={early}", *FAST_RUN], cli_env, inherited)
    assert (code, lines) == (130, [INTERRUPTED]) and not early.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
@pytest.mark.parametrize("module", ["moe_tune", "moe_tune.launch"])
@pytest.mark.slow
def test_a_stop_signal_while_starting_is_one_line(tmp_path, cli_env, module, signum):
    """SIGTERM or SIGUSR1 (a Slurm job cancelled or at its time limit while the run starts) before training: one
    line, exit 128 + the signal, nothing written (their default action would end it without a word)."""
    out = tmp_path / "run"
    args = (["--standalone", "--nproc-per-node", "2"] if module == "moe_tune.launch" else []) + [f"output_dir={out}"]
    code, lines = ctrl_c_while_starting(module, [*args, *FAST_RUN], cli_env, "default", signum)
    line = f"moe-tune: stopped by signal {int(signum)}; nothing saved since the last checkpoint"
    assert (code, lines) == (128 + signum, [line]) and not out.exists()


@pytest.mark.parametrize("inherited", INHERITED_SIGINT)
@pytest.mark.slow
def test_ctrl_c_to_the_launcher_before_torchrun_starts_is_one_line(tmp_path, cli_env, inherited):
    out = tmp_path / "run"
    args = ["--standalone", "--nproc-per-node", "2", f"output_dir={out}", *FAST_RUN]
    code, lines = ctrl_c_while_starting("moe_tune.launch", args, cli_env, inherited)
    assert (code, lines) == (130, [INTERRUPTED]) and not out.exists()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_ranks_whose_torchrun_is_killed_save_and_exit(tmp_path, cli_env):
    """torchrun's agent killed with SIGKILL (by hand, or by the out-of-memory killer) sends its ranks nothing: they
    stop as on its SIGTERM, saving the step they agree on, instead of training on as orphans."""
    import os
    import time

    run, log = tmp_path / "run", tmp_path / "log"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", "parallel.ep=2", *FAST_RUN]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moe_tune", *args]
    with open(log, "w") as out:  # a file, not a pipe: orphans would hold a pipe open
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cli_env)
    metrics, deadline = run / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    ranks = [int(p) for p in open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()]
    agent.kill()
    agent.wait()
    deadline = time.time() + 120
    while time.time() < deadline and not all(_gone(pid) for pid in ranks):
        time.sleep(0.5)
    left = [pid for pid in ranks if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert len(ranks) == 2 and not left, text[-3000:]
    assert re.search(rf"rank \d: the launcher \(pid {agent.pid}\) is gone", text), text[-3000:]
    assert "stopped by signal 15 after step" in text and "Traceback" not in text, text[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], text[-3000:]


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_with_the_launchers_code(tmp_path, cli_env):
    """A rank killed outright (SIGKILL: the out-of-memory killer, a node's cleanup): the launcher names the signal
    and exits 128 + it, as a shell and Slurm report a killed process (it said "exited with code -9", exit 137)."""
    import time

    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", "parallel.ep=2", *FAST_RUN]
    launcher = subprocess.Popen(
        LAUNCH + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env
    )
    metrics, deadline = run / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    ranks = [int(p) for p in open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()]
    import os

    os.kill(ranks[-1], signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 137, err[-3000:]
    assert re.search(r"moe-tune: rank \d was killed by SIGKILL; the launcher exits 137\n", err), err[-3000:]


@pytest.mark.slow
def test_a_ranks_exit_2_is_the_launchers(tmp_path, cli_env):
    r = subprocess.run(
        LAUNCH + [f"output_dir={tmp_path}", *BAD_FAMILY], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert BAD_FAMILY_LINE in r.stderr


@pytest.mark.parametrize(
    "bad, said", [("train.lr=-1", "train.lr=-1.0 is out of range"), ("train.stepz=1", "train.stepz")], ids=str
)
@pytest.mark.slow
def test_a_bad_value_or_key_is_one_line_before_any_rank_starts(tmp_path, cli_env, bad, said):
    """The launcher checks keys and values before torchrun starts the ranks: its one line is all of stderr (no
    torchrun banner or rank-failure lines), exit 2, nothing written."""
    out = tmp_path / "run"
    r = subprocess.run(LAUNCH + [f"output_dir={out}", bad], capture_output=True, text=True, env=cli_env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("moe-tune: error:"), r.stderr[-3000:]
    assert said in lines[0] and not out.exists()


def test_the_slurm_launcher_is_found_from_an_installed_moe_tune(tmp_path):
    """Outside the clone, as an installed moe_tune runs (the suite's own install is editable, whose import hook
    Hydra's listing of hydra_plugins does not see): the CLI's registration makes the class that
    hydra/launcher=submitit_slurm names one Hydra can instantiate."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "from hydra.core.plugins import Plugins\n"
        "from moe_tune.cli.train import register_launcher\n"
        "register_launcher()\n"
        "print(sorted(n for n in Plugins.instance().class_name_to_class if 'moe_tune_launcher' in n))\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['hydra_plugins.moe_tune_launcher.slurm.SlurmLauncher']", r.stdout
