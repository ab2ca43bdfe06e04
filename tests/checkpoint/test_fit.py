"""A resume checkpoint that does not fit the model is named by the settings that differ (meta.json's config), on
both sides, with a fix that fits whose checkpoint it is (new-user trial: the line listed parameter names and
said 'checkpoint.resume=none would start afresh over that run' of another run's checkpoint)."""

from __future__ import annotations

import os

import pytest

from moe_tune.checkpoint.fit import check_settings, mismatch_fix
from moe_tune.config import CheckpointError, Config
from tests.checkpoint.test_reshard import _plain_trainer


def _meta(**sections) -> dict:
    from dataclasses import asdict

    config = asdict(Config())
    for section, values in sections.items():
        config[section].update(values)
    return {"config": config}


def _cfg(output_dir: str, **sections) -> Config:
    cfg = Config()
    cfg.output_dir = output_dir
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize(
    ("saved", "now", "was", "has"),
    [
        ({"name": "lora", "rank": 16}, {"name": "lora", "rank": 8}, "peft.rank=16", "peft.rank=8"),
        ({"name": "lora"}, {"name": "none"}, "peft=lora", "peft=none"),
        ({"name": "none"}, {"name": "lora"}, "peft=none", "peft=lora"),
        ({"name": "lora", "target": ["experts"]}, {"name": "lora"}, "peft.target=[experts]", "[attention,experts]"),
    ],
)
def test_another_peft_is_named_on_both_sides_before_loading(tmp_path, saved, now, was, has):
    own = str(tmp_path / "run" / "checkpoints" / "step_6")
    with pytest.raises(CheckpointError) as e:
        check_settings(_meta(peft=saved), _cfg(str(tmp_path / "run"), peft=now), own)
    line = str(e.value)
    assert line.startswith(f"checkpoint {own} does not fit this run's model (checkpoint: {was}; this run: ")
    assert has in line and "\n" not in line
    assert line.endswith(
        f"resume with the checkpoint's settings ({was}), or train this model in another output_dir "
        "(checkpoint.resume=none starts afresh over it)"
    )
    # Another run's checkpoint (checkpoint.resume=<path>): starting afresh over this output_dir would not help it.
    with pytest.raises(CheckpointError) as e:
        check_settings(_meta(peft=saved), _cfg(str(tmp_path / "other"), peft=now), own)
    assert str(e.value).endswith(f"or train this model from its start, without checkpoint.resume={own}")


def test_same_peft_passes_and_lora_settings_do_not_count_without_lora(tmp_path):
    check_settings(_meta(peft={"name": "lora", "alpha": 8.0}), _cfg(str(tmp_path), peft={"name": "lora"}), "c")
    check_settings(_meta(peft={"rank": 4}), _cfg(str(tmp_path), peft={"rank": 8}), "c")  # peft=none on both
    check_settings({"config": {}}, _cfg(str(tmp_path)), "c")  # a meta.json without peft: the fallback decides


def test_another_model_is_named_after_the_parameters(tmp_path):
    saved = _meta(model={"name": "tiny_qwen3_moe", "family": "qwen3_moe"})
    cfg = _cfg(str(tmp_path), model={"name": "tiny_deepseek_v3", "family": "deepseek_v3"})
    fix = mismatch_fix(saved, cfg, str(tmp_path / "checkpoints" / "step_2"))
    assert fix == (
        "The checkpoint has model=tiny_qwen3_moe; this run has model=tiny_deepseek_v3: resume with the checkpoint's "
        "settings (model=tiny_qwen3_moe), or train this model in another output_dir (checkpoint.resume=none starts "
        "afresh over it)"
    )
    fix = mismatch_fix(_meta(), _cfg(str(tmp_path), model={"overrides": {"num_hidden_layers": 3}}), "/elsewhere/s")
    assert fix.startswith("The checkpoint has model.overrides={}; this run has model.overrides={num_hidden_layers:3}")
    assert mismatch_fix(_meta(), _cfg(str(tmp_path)), "/elsewhere/step_2") == (
        "Resume with the model it was saved from, or train this model from its start, without "
        "checkpoint.resume=/elsewhere/step_2"
    )


def test_load_refuses_another_rank_before_reading_tensors(tmp_path):

    saved = _plain_trainer(steps=1, num_hidden_layers=1)
    saved.cfg.output_dir = str(tmp_path)
    saved.cfg.peft.name, saved.cfg.peft.rank = "lora", 16  # as meta.json records a rank-16 LoRA run
    path = os.path.join(tmp_path, "checkpoints", "step_1")
    saved.save(path)
    resumed = _plain_trainer(steps=0, num_hidden_layers=1)
    resumed.cfg.output_dir = str(tmp_path)
    resumed.cfg.peft.name, resumed.cfg.peft.rank = "lora", 8
    with pytest.raises(CheckpointError, match=r"\(checkpoint: peft.rank=16; this run: peft.rank=8\)"):
        resumed.load(path)
