"""Export is atomic: the output directory is replaced as a whole, so files of an earlier export with another
sharding or layout never remain beside the new ones (transformers would load a mix, or the old weights)."""

from __future__ import annotations

import json
import os
import shutil

import torch

import moe_tune
from moe_tune.cli.export import main as export_main
from moe_tune.models.export import EXPORT_MARKER, write_checkpoint_atomic
from moe_tune.models.presets import build_tiny_checkpoint
from tests.harness import FAST_RUN, assert_hf_logits_equal, read_hf_tensors, run_main

STALE = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def _model(path: str, seed: int):
    src = build_tiny_checkpoint(path, overrides={"num_hidden_layers": 2}, seed=seed)
    return moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _plant_stale(out, like) -> None:
    """What an earlier export in 2 shards left: two shard files and an index naming them, and its mark."""
    os.makedirs(out, exist_ok=True)
    if not os.path.samefile(out, like):
        shutil.copy(os.path.join(like, EXPORT_MARKER), os.path.join(out, EXPORT_MARKER))
    weights = os.path.join(like, "model.safetensors")
    for name in STALE[:2]:
        shutil.copy(weights, os.path.join(out, name))
    with open(os.path.join(out, STALE[2]), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"model.embed_tokens.weight": STALE[0]}}, f)


def test_a_second_export_leaves_only_its_own_files(tmp_path):
    old, new = _model(str(tmp_path / "a"), seed=0), _model(str(tmp_path / "b"), seed=1)
    out = tmp_path / "hf"
    write_checkpoint_atomic(old, str(out), max_shard_bytes=200_000)
    assert len(list(out.glob("*.safetensors"))) > 2
    write_checkpoint_atomic(new, str(out))
    fresh = tmp_path / "fresh"
    write_checkpoint_atomic(new, str(fresh))
    assert sorted(os.listdir(out)) == sorted(os.listdir(fresh))
    assert "model.safetensors" in os.listdir(out) and "model.safetensors.index.json" not in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "fresh", "hf"]  # no temporary directory left
    a, b = read_hf_tensors(out), read_hf_tensors(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, new(ids).logits, rtol=1e-5, atol=1e-5)


def test_run_and_export_cli_replace_an_earlier_export(tmp_path):
    """hf/ of a resumed run and moe-tune-export's OUT hold exactly the new export, whatever was there."""
    run = tmp_path / "run"
    assert run_main([f"output_dir={run}", "train.steps=2", "checkpoint.every=2", *FAST_RUN]).returncode == 0
    first = sorted(os.listdir(run / "hf"))
    _plant_stale(run / "hf", run / "hf")
    out = tmp_path / "exported"
    _plant_stale(out, run / "hf")
    export_main([str(run / "checkpoints" / "step_2"), str(out)])
    assert sorted(os.listdir(out)) == first
    assert run_main([f"output_dir={run}", "train.steps=4", "checkpoint.every=2", *FAST_RUN]).returncode == 0
    assert sorted(os.listdir(run / "hf")) == first
    assert not [n for n in os.listdir(run) if n.startswith(".hf")]
    assert_hf_logits_equal(str(run / "hf"))


def test_exported_weights_are_readable_like_other_files(tmp_path):
    """safetensors writes its files 0600; exported weights follow the umask like the config beside them."""
    out = tmp_path / "hf"
    old_umask = os.umask(0o022)
    try:
        write_checkpoint_atomic(_model(str(tmp_path / "a"), seed=0), str(out))
    finally:
        os.umask(old_umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes


def test_built_in_base_model_weights_are_readable_like_other_files(tmp_path):
    """A built-in preset written as a checkpoint (``output_dir/base_model/`` of a LoRA run) follows the umask too."""
    from moe_tune.models.presets import build_tiny_checkpoint

    old_umask = os.umask(0o022)
    try:
        out = build_tiny_checkpoint(str(tmp_path / "base_model"), "tiny_qwen3_moe", seed=0)
    finally:
        os.umask(old_umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in os.scandir(out) if p.is_file()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes


def test_an_export_carries_the_remote_code_its_config_names(tmp_path):
    """config.json's auto_map (DeepSeek-V3's release names configuration_deepseek.py and modeling_deepseek.py) is
    exported as it is, so the files it names come along: trust_remote_code=True loads the export as it loads the
    source, and a second export replaces the first, those files included."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import save_tiny

    src = save_tiny(tmp_path / "src", "deepseek_v3")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    # Subclasses, as a release's own code defines its classes: loading remote code registers the classes it finds
    # for the auto classes, which on transformers' own classes would change every later save_pretrained of them.
    remote = {
        "configuration_deepseek": "from transformers import DeepseekV3Config as Base\n\n\n"
        "class DeepseekV3Config(Base):\n    pass\n",
        "modeling_deepseek": "from transformers import DeepseekV3ForCausalLM as Base\n\n"
        "from .configuration_deepseek import DeepseekV3Config\n\n\n"
        "class DeepseekV3ForCausalLM(Base):\n    config_class = DeepseekV3Config\n",
    }
    for name, code in remote.items():
        with open(os.path.join(src, f"{name}.py"), "w") as f:
            f.write(code)
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = str(tmp_path / "out")
    for _ in range(2):
        write_checkpoint_atomic(model, out)
    assert {"configuration_deepseek.py", "modeling_deepseek.py"} <= set(os.listdir(out))
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
