"""The real Trainer in process, on the default tiny job made fast."""

from __future__ import annotations

import pytest

from tests.harness import FAST_TRAINER


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(*overrides, out=None) -> Trainer`` writing into ``out`` (default: tmp_path), with no Hugging
    Face export; the process group it creates is destroyed after the test."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    def make(*overrides, out=None):
        out = out or tmp_path
        cfg = to_config(compose([f"output_dir={out}", "checkpoint.export_hf=false", *FAST_TRAINER, *overrides]))
        return Trainer(cfg)

    yield make
    destroy_distributed()
