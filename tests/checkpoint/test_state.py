"""``check_base``: the base a checkpoint of LoRA adapters resumes onto, and the line that refuses another."""

from __future__ import annotations

import json

import pytest

from moe_tune.checkpoint.state import check_base
from moe_tune.config import CheckpointError
from moe_tune.models.source_check import base_fingerprint

TINY = {"name": "tiny_qwen3_moe", "path": None, "overrides": {}}


def _draw(path, seed: int) -> str:
    """A stand-in for a tiny preset's base_model/ drawn with ``seed`` (its fingerprint changes with the seed)."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "drawn_with": seed}))
    return str(path)


def _meta(model: dict, seed: int, source: str) -> dict:
    return {
        "config": {"model": model, "train": {"seed": seed}},
        "source": source,
        "base_fingerprint": base_fingerprint(source),
    }


def test_a_built_in_base_drawn_with_another_seed_is_refused_naming_the_seed(tmp_path):
    """Adapters trained on tiny_qwen3_moe drawn with train.seed=0, resumed in the same output_dir with train.seed=1:
    the run draws base_model/ again with seed 1, so its fingerprint differs. The line names the seeds and gives the
    checkpoint's, rather than saying the files changed since training (nobody changed them: the run redrew them)."""
    base = tmp_path / "base_model"
    meta = _meta(TINY, 0, _draw(base, 0))
    check_base(meta, TINY, 0, str(base), "step_2")  # the same draw resumes

    _draw(base, 1)
    with pytest.raises(CheckpointError) as error:
        check_base(meta, TINY, 1, str(base), "step_2")
    line = str(error.value)
    assert f"this run draws {base} with train.seed=1" in line and "drawn with train.seed=0" in line, line
    assert "give train.seed=0" in line and "have changed" not in line, line

    other = {**TINY, "overrides": {"rope_theta": 500.0}}
    with pytest.raises(CheckpointError) as error:
        check_base(meta, other, 0, str(base), "step_2")
    assert "give model.overrides={}" in str(error.value) and "model.overrides={rope_theta:500.0}" in str(error.value)


def test_a_base_read_from_files_that_changed_names_its_files(tmp_path):
    """model.path: the base is what its files hold, whatever train.seed says; the line names the changed files."""
    base = tmp_path / "base"
    model = {**TINY, "name": "hf", "path": _draw(base, 0)}
    meta = _meta(model, 0, str(base))
    _draw(base, 1)
    with pytest.raises(CheckpointError) as error:
        check_base(meta, model, 1, str(base), "step_2")
    assert f"weight files of {base} have changed since the adapters were trained" in str(error.value)
    assert "train.seed" not in str(error.value)
