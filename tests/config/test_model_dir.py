"""``model.path`` without a config.json: one line saying what the path is (a hub id, which moe_tune does not
download; a file; a PEFT adapter, with its base model) and what to give instead. The CLI's own runs of these lines:
tests/cli/test_train.py."""

from __future__ import annotations

import json

from moe_tune.config.model_dir import model_dir_problem


def test_a_hub_id_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_dir_problem("Qwen/Qwen3-30B-A3B") == (
        f"model.path=Qwen/Qwen3-30B-A3B does not exist (no directory {tmp_path}/Qwen/Qwen3-30B-A3B); moe_tune reads "
        "local checkpoints only and downloads nothing from the Hugging Face hub: download it first (hf download "
        "Qwen/Qwen3-30B-A3B --local-dir <dir>), then give model.path=<dir>"
    )


def test_a_missing_absolute_path_gets_the_same_fix():
    line = model_dir_problem("/nonexistent/model")
    assert line.startswith("model.path=/nonexistent/model does not exist; moe_tune reads local checkpoints only")
    assert "(hf download <hub id> --local-dir <dir>)" in line


def test_a_file_and_a_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert model_dir_problem(str(tmp_path / "model.safetensors")).endswith(
        "is a file; give a local Hugging Face checkpoint directory (config.json, *.safetensors)"
    )
    assert model_dir_problem(str(tmp_path)) == (
        f"model.path={tmp_path} has no config.json; give a local Hugging Face checkpoint directory"
    )
    (tmp_path / "config.json").write_text("{}")
    assert model_dir_problem(str(tmp_path)) is None


def test_a_peft_adapter_names_its_base_and_the_newest_checkpoint(tmp_path):
    adapter = tmp_path / "run" / "hf"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/models/base"})
    )
    assert model_dir_problem(str(adapter)) == (
        f"model.path={adapter} is a PEFT LoRA adapter (adapter_config.json, no config.json), not a full model; its "
        "base model is /models/base (adapter_config.json's base_model_name_or_path): give model.path=/models/base, "
        "or merge the adapter into its base first (moe-tune-export <run>/checkpoints/step_<N> <dir> --merge, or "
        "PEFT's merge_and_unload) and give model.path=<dir>"
    )
    for step in (2, 10, 9):
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
    assert f"moe-tune-export {tmp_path}/run/checkpoints/step_10 <dir> --merge" in model_dir_problem(str(adapter))


def test_an_adapter_without_a_base_model(tmp_path):
    (tmp_path / "adapter_config.json").write_text("not json")
    line = model_dir_problem(str(tmp_path), key="path")
    assert line.startswith(f"path={tmp_path} is a PEFT adapter (adapter_config.json, no config.json), not a full")
    assert "its adapter_config.json names no base model: give path=<the base model's directory>" in line


def test_a_run_directory_names_its_exported_model(tmp_path):
    """A run's output_dir holds a config.json of its own (moe_tune's config, no model_type): the line names the
    model it exported, or the export to run; a checkpoint names the export and the run to continue."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "config.json").write_text('{"train": {}}')
    assert model_dir_problem(str(run)) == (
        f"model.path={run} is a moe-tune run directory with no exported model: run moe-tune-export "
        f"{run}/checkpoints/step_4 <dir> and give model.path=<dir>"
    )
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert model_dir_problem(str(run)) == (
        f"model.path={run} is a moe-tune run directory, not a model: its exported model is {run}/hf: give "
        f"model.path={run}/hf"
    )
    assert model_dir_problem(str(run / "hf")) is None
    assert model_dir_problem(str(run / "checkpoints" / "step_4")) == (
        f"model.path={run}/checkpoints/step_4 is a moe-tune training checkpoint, not a model: export it "
        f"(moe-tune-export {run}/checkpoints/step_4 <dir>, --merge for LoRA) and give model.path=<dir>; to continue "
        f"that run, rerun it with output_dir={run}"
    )


def test_a_mistyped_local_path_is_no_hub_id(tmp_path, monkeypatch):
    """``my/ckp`` looks like owner/name, but ``my/`` is here: a typo of ``my/ckpt``, not a model to download."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my" / "ckpt").mkdir(parents=True)
    assert (
        model_dir_problem("my/ckp")
        == "model.path=my/ckp does not exist (the directory my does, without ckp); did you mean my/ckpt?"
    )
    assert model_dir_problem("my/zzz").endswith("; check the path")
    assert "hf download Qwen/Qwen3-30B-A3B" in model_dir_problem("Qwen/Qwen3-30B-A3B")
