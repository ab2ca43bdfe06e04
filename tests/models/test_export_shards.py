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


@pytest.mark.parametrize("first,second", [(200_000, 4 << 30), (4 << 30, 200_000), (100_000, 200_000)])
def test_save_pretrained_over_an_earlier_save_leaves_only_its_own_weight_files(tmp_path, first, second):
    """An earlier save's index (sharded, then one file) was read by moe_tune in place of the new model.safetensors,
    and its model.safetensors (one file, then sharded) by transformers in place of the new shards: both loaded the
    earlier weights without a word."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 2})
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = tmp_path / "out"
    model.save_pretrained(str(out), max_shard_bytes=first)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    model.save_pretrained(str(out), max_shard_bytes=second)
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.load(open(index))["weight_map"].values())) if index.exists() else ["model.safetensors"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        again = moe_tune.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
        ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        torch.testing.assert_close(ref(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_save_pretrained_over_its_own_source_directory(tmp_path):
    """As transformers' save_pretrained can: it wrote the weights and config.json, then failed copying the tokenizer
    and generation config onto themselves (shutil.SameFileError)."""
    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 2})
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    model.save_pretrained(src)
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        again = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_adapters_saved_into_their_base_directory_are_refused_and_the_base_kept(tmp_path):
    """An adapter save replaces the directory's weights (as over an earlier full save): into the base model's own
    directory it deleted the base's model.safetensors, the weights the adapters it wrote point to."""
    from moe_tune.config import ConfigError
    from moe_tune.lora import LoRASpec

    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 2})
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, lora=LoRASpec(rank=8))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "src")
    for out in (src, str(link)):
        with pytest.raises(ConfigError, match=r"LoRA adapters into the directory of their base model .*new directory"):
            model.save_pretrained(out)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == before
    model.save_pretrained(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_config.json").exists()


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
    write_checkpoint(model, str(out))  # as moe-tune-export --merge writes it (save_pretrained writes the adapters)
    source, saved = load_file(f"{src}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(k for k in saved if ".lora." not in k) == sorted(source)
    assert [k for k in source if not torch.equal(saved[k], source[k])] == []


def test_save_pretrained_of_a_lora_model_writes_the_adapters_peft_loads(tiny_checkpoint, tmp_path):
    """As PEFT's save_pretrained: a model with LoRA adapters saves them as a PEFT adapter directory, whose
    PeftModel onto the source gives this model's logits (1e-5), and no base weight beside them (they were written
    under moe_tune's own adapter keys into model.safetensors, which transformers loaded without the adapters)."""
    import peft
    from transformers import AutoModelForCausalLM

    from moe_tune.lora import LoRASpec

    src = tiny_checkpoint("qwen3_moe", dtype=torch.float32)
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, lora=LoRASpec(rank=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("B"):  # B starts at zero: adapters that change the logits
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    out = tmp_path / "saved"
    model.save_pretrained(str(out))
    names = {f.name for f in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "config.json" not in names, names
    assert not [n for n in names if n.startswith("model")], names
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_merging_adapters_into_quantized_experts_is_refused_before_anything_merges(tiny_checkpoint):
    """Experts held quantized hold no weight to merge into: one ConfigError naming the way (PEFT's merge onto the
    source, or a model built without quantized_base), raised before any adapter is folded (it stopped with an
    AttributeError halfway, the attention's adapters already merged and removed)."""
    from moe_tune.config import ConfigError
    from moe_tune.lora import LoRASpec
    from moe_tune.models.lora import has_lora, merge_lora
    from moe_tune.moe.experts import ExpertsOptions

    src = tiny_checkpoint("qwen3_moe", dtype=torch.bfloat16, hidden_size=64, moe_intermediate_size=96)
    lora = LoRASpec(rank=8)
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, experts=ExpertsOptions(quantized_base="nf4"), lora=lora)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"quantized_base=nf4\) with adapters.*merge_and_unload"):
        merge_lora(model)
    assert has_lora(model) and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_save_pretrained_between_adapters_and_a_merged_model_leaves_only_the_last_save(tmp_path):
    """A merged save over an adapter save leaves no adapter_config.json: transformers loads a directory holding
    one as the base plus those adapters (logits 0.8 from the merged model's). An adapter save over a full save
    leaves no model.safetensors, which moe_tune would read as the model."""
    from transformers import AutoModelForCausalLM

    from moe_tune.lora import LoRASpec
    from moe_tune.models.lora import merge_lora

    src = build_tiny_checkpoint(str(tmp_path / "src"), overrides={"num_hidden_layers": 2})
    out = tmp_path / "out"
    moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(str(out))
    model = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, lora=LoRASpec(rank=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(str(out))
    assert not list(out.glob("model*.safetensors*"))
    merge_lora(model)
    model.save_pretrained(str(out))
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    ids = torch.randint(4, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        torch.testing.assert_close(ref(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_moe", "gpt_oss"])
def test_a_bf16_export_writes_the_dtypes_transformers_bf16_save_writes(tmp_path, tiny_checkpoint, family):
    """``model.dtype=bfloat16``: every tensor bf16 but those transformers keeps in fp32 whatever the dtype
    (DeepSeek-V3's and GLM-4-MoE's router weight and e_score_correction_bias), key for key the dtypes of
    transformers' own save_pretrained of the model loaded in bf16; rounded, they chose other experts."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    def dtypes(path) -> dict:
        out = {}
        for file in path.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
        return out

    src = tiny_checkpoint(family)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    write_checkpoint(moe_tune.AutoModelForCausalLM.from_pretrained(src), str(tmp_path / "ours"), dtype=torch.bfloat16)
    theirs = dtypes(tmp_path / "hf")
    assert dtypes(tmp_path / "ours") == theirs
    assert ("F32" in theirs.values()) == (family in ("deepseek_v3", "glm4_moe"))
