"""The package as a user installs it from PyPI (issue 18, item 3): a wheel built from this checkout, installed into a
fresh virtual environment (``--system-site-packages``: torch and the other dependencies come from this one, the
wheel's moe_tune shadows the checkout's), carries its configs and runs the default fine-tune from another
directory."""

import os
import shutil
import subprocess
import zipfile

import pytest

from tests.harness import FAST_RUN, LAUNCH_VARS, PY, ROOT, read_metrics


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-4000:])
    return r


@pytest.mark.slow
def test_wheel_runs_the_default_fine_tune_from_another_directory(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info behind
    shutil.copytree(os.path.join(ROOT, "moe_tune"), src / "moe_tune", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    _run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src])
    (wheel,) = (tmp_path / "dist").glob("moe_tune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"moe_tune/conf/config.yaml", "moe_tune/conf/model/tiny_qwen3_moe.yaml"} <= names

    venv = tmp_path / "venv"
    _run([PY, "-m", "venv", "--system-site-packages", venv])
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
