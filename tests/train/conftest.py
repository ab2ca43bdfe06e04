"""The real Trainer in process, on the default tiny job made fast."""

from __future__ import annotations

import pytest

from tests.harness import FAST_TRAINER


def trainer_for(out, *overrides):
    """A Trainer of the default tiny job made fast, writing into ``out``, with no Hugging Face export."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.train import Trainer

    return Trainer(to_config(compose([f"output_dir={out}", "checkpoint.export_hf=false", *FAST_TRAINER, *overrides])))


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(*overrides, out=None) -> Trainer`` writing into ``out`` (default: tmp_path), with no Hugging
    Face export; the process group it creates is destroyed after the test."""
    from moe_tune.distributed.process_group import destroy_distributed

    def make(*overrides, out=None):
        return trainer_for(out or tmp_path, *overrides)

    yield make
    destroy_distributed()
