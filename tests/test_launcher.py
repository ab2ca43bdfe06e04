"""``python -m moe_tune.launch``: torchrun running moe_tune, exiting with the code a scheduler needs (torchrun
itself exits 1 with its agent's traceback on SIGTERM, and 1 for a rank's exit 2)."""

from __future__ import annotations

import signal
import subprocess

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


def test_sigterm_exits_143_without_a_traceback(tmp_path, cli_env):
    """SIGTERM to the launcher: both ranks save the agreed step; the launcher exits 128 + 15 with one line."""
    run = tmp_path / "run"
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", "parallel.ep=2", *FAST_RUN]
    code, err = signal_after_rows(LAUNCH + args, cli_env, run, 2, signal.SIGTERM)
    assert code == 143, err[-3000:]
    assert "moe-tune: stopped by signal 15" in err and "Traceback" not in err, err[-3000:]
    assert [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()], err[-3000:]


def test_a_ranks_exit_2_is_the_launchers(tmp_path, cli_env):
    r = subprocess.run(
        LAUNCH + [f"output_dir={tmp_path}", *BAD_FAMILY], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert BAD_FAMILY_LINE in r.stderr


def test_a_value_both_ranks_find_bad_is_said_once(tmp_path, cli_env):
    """Found before any process group: the node's first rank prints it, and the launcher adds no line of its own
    for an exit 2 (the rank said why)."""
    out = tmp_path / "run"
    r = subprocess.run(LAUNCH + [f"output_dir={out}", "train.lr=-1"], capture_output=True, text=True, env=cli_env)
    ours = [line for line in r.stderr.splitlines() if line.startswith("moe-tune:")]
    assert r.returncode == 2 and len(ours) == 1 and "train.lr=-1.0 is out of range" in ours[0], r.stderr[-3000:]
    assert not out.exists()


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
