"""``python -m moe_tune.launch``: torchrun running moe_tune, exiting with the code a scheduler needs (torchrun
itself exits 1 with its agent's traceback on SIGTERM, and 1 for a rank's exit 2)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from moe_tune.launch import split_argv
from tests.harness import FAST_RUN, PY, signal_after_rows
from tests.test_cli import BAD_FAMILY, BAD_FAMILY_LINE

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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_a_stop_signal_exits_128_plus_it_without_a_traceback(tmp_path, cli_env, signum):
    """SIGTERM (Slurm) or SIGINT (Ctrl-C in the terminal reaches the launcher, which passes it on) to the
    launcher: both ranks save the agreed step; the launcher exits 128 + the signal with one line."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", "parallel.ep=2", *FAST_RUN]
    code, err = signal_after_rows(LAUNCH + args, cli_env, run, 2, signum)
    assert code == 128 + signum, err[-3000:]
    assert f"moe-tune: stopped by signal {int(signum)}" in err and "Traceback" not in err, err[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]


def test_ctrl_c_in_one_process_saves_and_before_training_is_one_line(tmp_path, cli_env):
    """moe-tune alone: Ctrl-C stops after the next agreed step with a checkpoint (exit 130, no traceback); a
    Ctrl-C before training starts is one line, exit 130."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", *FAST_RUN]
    code, err = signal_after_rows([PY, "-m", "moe_tune", *args], cli_env, run, 2, signal.SIGINT)
    assert code == 130 and "stopped by signal 2 after step" in err and "Traceback" not in err, err[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]
    early = subprocess.Popen(
        [PY, "-m", "moe_tune", f"output_dir={tmp_path / 'early'}", *FAST_RUN],
        env=cli_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # importing torch and composing: not training yet
    early.send_signal(signal.SIGINT)
    _, err = early.communicate(timeout=120)
    assert early.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "moe-tune: interrupted; nothing saved since the last checkpoint"


def test_a_ranks_exit_2_is_the_launchers(tmp_path, cli_env):
    r = subprocess.run(
        LAUNCH + [f"output_dir={tmp_path}", *BAD_FAMILY], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert BAD_FAMILY_LINE in r.stderr


@pytest.mark.parametrize(
    "bad, said", [("train.lr=-1", "train.lr=-1.0 is out of range"), ("train.stepz=1", "train.stepz")], ids=str
)
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
        "from moe_tune.cli import register_launcher\n"
        "register_launcher()\n"
        "print(sorted(n for n in Plugins.instance().class_name_to_class if 'moe_tune_launcher' in n))\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['hydra_plugins.moe_tune_launcher.slurm.SlurmLauncher']", r.stdout
