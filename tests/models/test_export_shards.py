"""Export streams: with a small shard limit one process writes several Hugging Face-named files and an index,
and transformers loads them with the same logits."""

import json

import pytest
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


def test_an_export_in_another_dtype_says_so_in_config_json(tmp_path):
    """Weights written in a forced dtype (``dtype``: the run's model.dtype) are that dtype in config.json too, so
    transformers' default from_pretrained loads them as they are (it loaded a bf16 export of an fp32 source as fp32)."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 1})
    source_dtype = json.load(open(tmp_path / "src" / "config.json")).get("dtype")
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        out = tmp_path / str(dtype)
        write_checkpoint(model, str(out), dtype=dtype)
        assert json.load(open(out / "config.json"))["dtype"] == str(dtype).removeprefix("torch.")
        assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == dtype
    write_checkpoint(model, str(tmp_path / "as_source"))
    assert json.load(open(tmp_path / "as_source" / "config.json")).get("dtype") == source_dtype


@pytest.mark.parametrize("mode", ["fp8", "nf4"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_a_quantized_base_saves_the_experts_of_its_source(tiny_checkpoint, tmp_path, model_type, mode):
    """A model whose routed experts are held quantized (the Python API's ``quantized_base``, ``peft.quantize_base``)
    saves every tensor of its source, the experts as the source's files hold them (per-expert keys for Qwen3-MoE,
    stacked ones for GPT-OSS), bit for bit: never dequantized values, never without them (the experts were left out,
    and transformers drew them at random on loading the directory)."""
    from safetensors.torch import load_file

    from moe_tune.lora import LoRASpec
    from moe_tune.moe.experts import ExpertsOptions

    size = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    src = tiny_checkpoint(model_type, dtype=torch.bfloat16, hidden_size=64, **{size: 96})
    model = moe_tune.AutoModelForCausalLM.from_pretrained(
        src, experts=ExpertsOptions(quantized_base=mode), lora=LoRASpec(rank=8, targets=("attention",))
    )
    out = tmp_path / "saved"
    model.save_pretrained(str(out))
    source, saved = load_file(f"{src}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(k for k in saved if ".lora." not in k) == sorted(source)
    assert [k for k in source if not torch.equal(saved[k], source[k])] == []
