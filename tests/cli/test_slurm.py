"""``hydra/launcher=submitit_slurm``: the presets' task counts follow the layout, and a job's ranks come back as one
line (the real Slurm runs: tests/slurm/test_submitit.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_tune.cli.slurm import RankExit, exit_of, failure_line
from moe_tune.cli.train import CONF_DIR
from moe_tune.config import ConfigError, UserError, register_configs
from moe_tune.config.schema import ranks_per_node
from tests.harness import PY


def launcher(*overrides: str) -> dict:
    """The resolved ``hydra.launcher`` node of a composed config, as the submitter instantiates it."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_tasks_follow_the_layout():
    gpu = launcher("hydra/launcher=submitit_slurm", "parallel.ep=2")
    assert (gpu["nodes"], gpu["tasks_per_node"], gpu["gpus_per_node"]) == (1, 2, 2)
    assert gpu["_target_"] == "hydra_plugins.moe_tune_launcher.slurm.SlurmLauncher"
    two_nodes = launcher(
        "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2", "parallel.ep=8", "parallel.dp_shard=16"
    )
    assert (two_nodes["tasks_per_node"], two_nodes["gpus_per_node"]) == (8, 8)
    cpu = launcher("hydra/launcher=submitit_slurm_cpu", "parallel.ep=2")
    assert (cpu["tasks_per_node"], cpu["gpus_per_node"]) == (2, None)  # no GPU request a CPU partition refuses


def test_ranks_per_node():
    assert ranks_per_node(1, -1, 1, 1) == 1  # the default layout: one rank
    assert ranks_per_node(2, -1, 4, 2) == 4  # dp_replicate x ep over two nodes
    assert ranks_per_node(1, 16, 8, 2) == 8
    with pytest.raises(ConfigError, match=r"do not split over hydra.launcher.nodes=2"):
        ranks_per_node(1, -1, 3, 2)


def _fail_like_the_cli(message: str) -> SystemExit:
    """cli.run calls cli.fail (print, SystemExit(2)) while handling the UserError: the exit has it as context."""
    try:
        try:
            raise UserError(message)
        except UserError:
            raise SystemExit(2)  # noqa: B904 (as cli.fail does: the UserError stays its __context__)
    except SystemExit as e:
        return e


def test_exit_of_each_way_a_job_ends():
    assert exit_of(None) == (0, "")
    assert exit_of(_fail_like_the_cli("parallel.ep (3) must divide 2;\n try parallel.ep=1")) == (
        2,
        "parallel.ep (3) must divide 2; try parallel.ep=1",
    )
    assert exit_of(SystemExit(143)) == (143, "")  # stopped by a signal: the trainer logged why
    assert exit_of(RuntimeError("out of memory\nmore")) == (1, "RuntimeError: out of memory")


def test_failure_line_groups_ranks():
    exits = [RankExit("7", 0, 3, 2, "bad value"), RankExit("7", 1, 3, 0), RankExit("7", 2, 3, 2, "bad value")]
    assert failure_line(exits) == "job 7: ranks 0,2 exited with code 2: bad value"
    exits = [RankExit("8", 0, 2, 143), RankExit("8", 1, 2, 1, "RuntimeError: x")]
    assert failure_line(exits) == "job 8: rank 0 exited with code 143; rank 1 exited with code 1: RuntimeError: x"


@pytest.mark.slow
def test_without_the_slurm_extra_one_line_and_exit_2(tmp_path, cli_env):
    """No hydra-submitit-launcher (hidden here by a package of its name that fails to import): one line naming the
    extra, exit 2 (Hydra's own: a multi-line plugin error and exit 1)."""
    hidden = tmp_path / "hydra_plugins" / "hydra_submitit_launcher"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = dict(cli_env, PYTHONPATH=f"{tmp_path}{os.pathsep}{cli_env['PYTHONPATH']}")
    r = subprocess.run(
        [PY, "-m", "moe_tune", "hydra/launcher=submitit_slurm", f"output_dir={tmp_path / 'run'}", "-m"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (
        "moe-tune: error: hydra/launcher=submitit_slurm and submitit_slurm_cpu need Hydra's submitit launcher: "
        "pip install 'moe_tune[slurm]'"
    )
    assert not (tmp_path / "run" / "multirun" / "0").exists()


def test_the_job_exit_code_is_a_reported_error_not_a_rank_slurm_stopped():
    from moe_tune.cli.slurm import RankExit, job_exit_code

    stopped = RankExit("7", 0, 2, -1)  # stopped by Slurm once rank 1 had failed: submitit's -1, no line
    failed = RankExit("7", 1, 2, 2, "train.global_batch_size (3) must be a multiple ...")
    assert job_exit_code([stopped, failed]) == 2
    assert job_exit_code([stopped, RankExit("7", 1, 2, 0)]) == 1  # never -1 (a shell's 255)
    assert job_exit_code([RankExit("7", 0, 2, 143, "stopped"), RankExit("7", 1, 2, 143, "stopped")]) == 143


def test_submitit_warnings_are_printed_once():
    """submitit's logger sends a warning to its stdout handler (every level) and its stderr handler (warnings): a
    terminal showed each sacct warning twice. After warnings_once: on stderr only; its INFO lines stay on stdout."""
    import io
    import logging

    submitit = pytest.importorskip("submitit")
    from moe_tune.cli.slurm import warnings_once

    assert submitit  # its import configured the logger this test copies
    levels = sorted(h.level for h in logging.getLogger("submitit").handlers)
    assert levels == [logging.DEBUG, logging.WARNING]  # the shape warnings_once expects
    logger = logging.getLogger("moe_tune_test_submitit")
    out, err = io.StringIO(), io.StringIO()
    for stream, level in ((out, logging.DEBUG), (err, logging.WARNING)):
        handler = logging.StreamHandler(stream)
        handler.setLevel(level)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    warnings_once(logger)
    warnings_once(logger)  # once is enough: a second call adds nothing
    logger.warning("Call #1 - Bypassing sacct error")
    logger.info("submitted")
    assert (out.getvalue(), err.getvalue()) == ("submitted\n", "Call #1 - Bypassing sacct error\n")


def _fake_sacct(tmp_path, monkeypatch, code: int, stderr: str) -> None:
    sacct = tmp_path / "bin" / "sacct"
    sacct.parent.mkdir()
    sacct.write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit {code}\n")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sacct.parent}{os.pathsep}{os.environ['PATH']}")


def test_without_accounting_one_note_and_no_sacct_polls(tmp_path, monkeypatch, capsys):
    """Where sacct cannot answer (Slurm accounting off), the submitter says so once and does not poll it: each poll
    printed sacct's line and submitit's warning (twice), every minute of a long job."""
    submitit = pytest.importorskip("submitit")
    from moe_tune.cli.slurm import accounting_problem, quiet_submitit

    _fake_sacct(tmp_path, monkeypatch, 1, "Slurm accounting storage is disabled")
    assert accounting_problem() == "sacct: Slurm accounting storage is disabled"
    watcher = submitit.SlurmJob.watcher
    with quiet_submitit():
        polled = submitit.SlurmJob.watcher
        polled.register_job("12")
        monkeypatch.setattr(subprocess, "check_output", lambda *a, **k: pytest.fail("sacct was polled"))
        assert polled.get_state("12", mode="force") == "UNKNOWN"  # the result files tell when the job ended
    assert submitit.SlurmJob.watcher is watcher
    assert capsys.readouterr().err == (
        "moe-tune: note: Slurm accounting is not available here (sacct: Slurm accounting storage is disabled): the "
        "submitter learns that a job ended from its tasks' results, so a job killed before writing them (scancel, a "
        "lost node) leaves it waiting\n"
    )


def test_with_accounting_sacct_is_polled_as_ever(tmp_path, monkeypatch, capsys):
    submitit = pytest.importorskip("submitit")
    from moe_tune.cli.slurm import accounting_problem, quiet_submitit

    _fake_sacct(tmp_path, monkeypatch, 1, "sacct: error: Problem talking to the database: Connection refused")
    assert accounting_problem() is None  # a database down for a while: the polls may work later
    (tmp_path / "bin" / "sacct").write_text("#!/bin/sh\nexit 0\n")
    assert accounting_problem() is None
    watcher = submitit.SlurmJob.watcher
    with quiet_submitit():
        assert submitit.SlurmJob.watcher is watcher
    assert capsys.readouterr().err == ""
