"""Export streams: with a small shard limit one process writes several Hugging Face-named files and an index,
and transformers loads them with the same logits."""

import json

import torch

import moe_tune
from moe_tune.models.export import write_checkpoint
from moe_tune.models.presets import build_tiny_checkpoint


def test_small_shard_limit_gives_hf_sharded_checkpoint(tmp_path):
    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 2})
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = tmp_path / "out"
    write_checkpoint(model, str(out), max_shard_bytes=200_000)
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
