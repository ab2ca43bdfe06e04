"""Fixtures for every test directory. Helpers live in modules: tests/harness.py (ranks in processes, the CLI in a
subprocess, run outputs) and tests/tiny.py (tiny random Hugging Face checkpoints, ``rel_err``)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from tests import harness, tiny


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist runs a worker per core: one thread each, or the workers' thread pools oversubscribe them.
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """Runs that name no data.cache_dir cache tokenized data under HF_DATASETS_CACHE (moe_tune.data.cache): a
    directory of this test session, not the user's ~/.cache; subprocesses and spawned ranks inherit it."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets_cache")))
    yield
    patch.undo()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The slow tests (whole runs as processes, up to minutes each) first, so that no worker starts one last
        # while the other has finished: the stable sort keeps each lane's own order.
        items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kept_signals():
    """The stop signals' handlers as they were, after a test that lets the command's code change them (an ignored
    one left behind would be kept ignored by the next test's handlers)."""
    import signal

    from moe_tune.cli.train import STOP_SIGNALS

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *STOP_SIGNALS)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running `python -m moe_tune` in a subprocess on one CPU process."""
    return harness.cli_env()


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """``tiny_checkpoint(model_type="qwen3_moe", dtype=torch.float32, seed=0, **config_overrides) -> str``: a tiny
    random Hugging Face checkpoint (``tiny.save_tiny``) saved in a new directory under the test's tmp_path."""
    count = itertools.count()

    def make(model_type: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> str:
        return tiny.save_tiny(tmp_path / f"tiny_{model_type}_{next(count)}", model_type, dtype, seed, **overrides)

    return make


@pytest.fixture
def no_launcher(monkeypatch):
    """No torchrun or Slurm variables: ``init_distributed`` makes a one-process group (gloo on CPU)."""
    for key in harness.LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
