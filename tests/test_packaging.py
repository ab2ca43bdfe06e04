"""The package as a user installs it from PyPI (issue 18, item 3): a wheel built from this checkout, installed into a
fresh virtual environment, carries its configs and runs the default fine-tune from another directory."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.harness import FAST_RUN, LAUNCH_VARS, PY, ROOT, read_metrics


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-4000:])
    return r


def running_site_dirs() -> list[str]:
    """The directories this interpreter imports from, outside the checkout: where torch, Hydra and the other
    dependencies are, whether this is a virtualenv (whose base interpreter lacks them, so a
    ``--system-site-packages`` venv would not see them), a conda env or a system install (user site included)."""
    root = os.path.realpath(ROOT)
    dirs = []
    for entry in filter(None, sys.path):  # "": the current directory, the checkout when pytest runs there
        path = os.path.realpath(entry)
        if os.path.isdir(path) and path != root and not path.startswith(root + os.sep) and path not in dirs:
            dirs.append(path)
    return dirs


def add_site_dirs(venv, dirs: list[str]) -> None:
    """Append ``dirs`` to ``venv``'s sys.path, after its own site-packages (the wheel's moe_tune comes first). Plain
    lines in a .pth file: the .pth files inside those directories are not run, so an editable install of this
    checkout there does not put the checkout on the path."""
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    (site_packages / "running_interpreter.pth").write_text("".join(d + "\n" for d in dirs))


@pytest.mark.slow
def test_wheel_runs_the_default_fine_tune_from_another_directory(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info behind
    for package in ("moe_tune", "hydra_plugins"):  # pyproject.toml's packages
        shutil.copytree(os.path.join(ROOT, package), src / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    _run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src])
    (wheel,) = (tmp_path / "dist").glob("moe_tune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "moe_tune/conf/config.yaml",
        "moe_tune/conf/model/tiny_qwen3_moe.yaml",
        "hydra_plugins/moe_tune_launcher/slurm.py",  # the CLI registers this launcher at start
    } <= names

    venv = tmp_path / "venv"
    _run([PY, "-m", "venv", venv])
    add_site_dirs(venv, running_site_dirs())
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARS, "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import moe_tune; print(moe_tune.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's copy, not the checkout's
    r = _run([venv / "bin" / "moe-tune", "train.steps=2", *FAST_RUN, "output_dir=run"], cwd=elsewhere, env=env)
    assert [row["step"] for row in read_metrics(elsewhere / "run")] == [1, 2]
    assert (elsewhere / "run" / "hf" / "config.json").is_file() and "outputs in" in r.stderr
