"""Checkpoints published in block-scaled FP8 (models/fp8_checkpoint.py; DeepSeek-V3's release, Qwen3-*-FP8): read
row range by row range as the weights they stand for, giving transformers' own dequantized model's logits; a
quantized LoRA base made from them equals one made from their dequantized weights; exports are bf16 with no
quantization_config; any other quantization is refused before anything is built."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_tune.config import CheckpointError
from moe_tune.models.hf_io import CheckpointReader
from moe_tune.models.source_check import check_source_dir
from tests.tiny import VOCAB, rel_err, save_tiny

# Smaller than the releases' [128, 128], so that the tiny models' weights span several blocks, partial ones at
# the edges (48 = 2 x 16 + 16 rows; 80 = 2 x 32 + 16 columns).
BLOCK = [16, 32]
# transformers' dequantization needs whole blocks (it refuses a partial one in fused experts): a block that
# divides every tiny dim.
WHOLE_BLOCKS = [8, 8]
# fp32 logits of the same dequantized weights, in moe_tune and in transformers (as the family parity tests).
TOL = 1e-5


def _quantize_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values, fp32 block multipliers) as the releases store them: each block scaled so its largest value
    is E4M3's largest (448)."""
    (N, K), (bn, bk) = w.shape, block
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:N, :K].to(torch.float8_e4m3fn)
    return q, scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The reference: every value times its block's multiplier, in fp32 (through kron, not the reader's gather)."""
    expanded = torch.kron(scale, torch.ones(*block))[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


def fp8_checkpoint(src: str, out: str, block=BLOCK) -> dict[str, torch.Tensor]:
    """``src`` rewritten as a block-scaled FP8 release in ``out``: every 2-d ``*_proj.weight`` (attention, experts,
    dense and shared MLPs) quantized, embeddings, norms and routers as they are. Returns the dequantized weights
    (fp32) by key."""
    os.makedirs(out, exist_ok=True)
    reference = {}
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if not name.endswith(".safetensors"):
            if os.path.isfile(path):
                with open(path, "rb") as f, open(os.path.join(out, name), "wb") as g:
                    g.write(f.read())
            continue
        tensors = {}
        for key, t in load_file(path).items():
            if key.endswith("_proj.weight") and t.dim() == 2:
                q, scale = _quantize_blocks(t, block)
                tensors[key], tensors[key + "_scale_inv"] = q, scale
                reference[key] = _dequantized(q, scale, block)
            else:
                tensors[key] = t
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def test_the_reader_dequantizes_any_row_range(tmp_path):
    """Row ranges inside one block, across block edges and over the partial last block read as the reference's
    rows, bitwise; the scales count as read; the weight's dtype is bf16 (what an export writes)."""
    reference = fp8_checkpoint(save_tiny(tmp_path / "base", "qwen3_moe"), str(tmp_path / "fp8"))
    reader = CheckpointReader(str(tmp_path / "fp8"))
    key = "model.layers.0.mlp.experts.3.gate_proj.weight"  # [40, 48]: blocks of rows 0-15, 16-31, 32-39
    for start, stop in ((0, 40), (3, 9), (14, 18), (15, 33), (32, 40), (39, 40)):
        assert torch.equal(reader.rows(key, start, stop), reference[key][start:stop]), (start, stop)
    assert torch.equal(reader.rows(key), reference[key])
    assert key + "_scale_inv" in reader.used and reader.dtype(key) == torch.bfloat16
    assert reader.dtype("model.layers.0.input_layernorm.weight") == torch.float32


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_an_fp8_release_gives_transformers_dequantized_logits(tmp_path, family):
    """moe_tune's model from the FP8 files against transformers' own reading of them (FineGrainedFP8Config with
    dequantize=True), fp32: the same weights, so the same logits; and far from the model before quantization (the
    FP8 rounding counts)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from moe_tune.build import from_pretrained

    base = save_tiny(tmp_path / "base", family)
    fp8_checkpoint(base, str(tmp_path / "fp8"), WHOLE_BLOCKS)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = from_pretrained(str(tmp_path / "fp8")).eval()(ids).logits
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fp8"),
        quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    assert rel_err(ours, hf(input_ids=ids).logits) < TOL
    assert rel_err(ours, from_pretrained(base).eval()(ids).logits) > 100 * TOL


def test_a_quantized_lora_base_from_fp8_files_equals_one_from_their_weights(tmp_path):
    """``peft.quantize_base=fp8`` quantizes the experts again, shard by shard, from the dequantized rows: the
    codes and scales equal those made from a plain (fp32) copy of the same weights, bit for bit."""
    import shutil

    from moe_tune.build import from_pretrained
    from moe_tune.lora import LoRASpec
    from moe_tune.models.presets import build_tiny_checkpoint
    from moe_tune.moe.experts import ExpertsOptions

    base, fp8, plain = (str(tmp_path / n) for n in ("base", "fp8", "plain"))
    reference = fp8_checkpoint(build_tiny_checkpoint(base), fp8)
    shutil.copytree(base, plain)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    save_file({**tensors, **reference}, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    lora, experts = LoRASpec(rank=8, targets=("attention", "experts")), ExpertsOptions(quantized_base="fp8")
    a, b = (dict(from_pretrained(p, lora=lora, experts=experts).named_buffers()) for p in (fp8, plain))
    codes = [n for n, t in a.items() if t.dtype == torch.float8_e4m3fn]
    assert codes and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in codes)
    assert all(torch.equal(a[n], b[n]) for n in a if n not in codes)


def test_a_full_fine_tune_of_an_fp8_release_exports_bf16(tmp_path):
    """The export of a model read from FP8 files: bf16 weights (the dequantized ones, rounded once), no scales, and
    a config.json without quantization_config, which transformers then loads as a plain bf16 model."""
    from transformers import AutoModelForCausalLM

    from moe_tune.build import from_pretrained
    from moe_tune.models.export import write_checkpoint

    reference = fp8_checkpoint(save_tiny(tmp_path / "base", "qwen3_moe"), str(tmp_path / "fp8"))
    write_checkpoint(from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    written = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            written.update(load_file(str(tmp_path / "out" / name)))
    assert not any(k.endswith("_scale_inv") for k in written)
    key = "model.layers.1.self_attn.o_proj.weight"
    assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], reference[key].bfloat16())
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))  # a plain checkpoint now


@pytest.mark.parametrize(
    "quantization, named",
    [
        ({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt='e5m2'"),
    ],
    ids=["mxfp4", "gptq", "fp8_per_tensor", "fp8_e5m2"],
)
def test_other_quantizations_are_refused_naming_the_fix(tmp_path, quantization, named):
    base = save_tiny(tmp_path / "base", "qwen3_moe")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config["quantization_config"] = quantization
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="give the model's bf16 release") as e:
        check_source_dir(base)
    assert named in str(e.value) and "config.json" in str(e.value)


def test_the_files_hold_what_the_test_writes(tmp_path):
    """The helper writes what a release holds: E4M3 weights with fp32 block multipliers of ceil-divided shape."""
    fp8_checkpoint(save_tiny(tmp_path / "base", "qwen3_moe"), str(tmp_path / "fp8"))
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        key = "model.layers.0.self_attn.q_proj.weight"
        assert f.get_slice(key).get_dtype() == "F8_E4M3" and f.get_slice(key + "_scale_inv").get_dtype() == "F32"
        n, k = f.get_slice(key).get_shape()
        assert f.get_slice(key + "_scale_inv").get_shape() == [-(-n // BLOCK[0]), -(-k // BLOCK[1])]


@pytest.mark.parametrize("damage", ["scale_missing", "no_quantization_config"])
def test_fp8_weights_without_their_scales_are_refused_by_name(tmp_path, damage):
    """An E4M3 weight the reader cannot scale (its scale tensor missing, or config.json not saying it is
    quantized) stops the load naming the tensor, instead of training on unscaled values."""
    from moe_tune.build import from_pretrained

    fp8 = str(tmp_path / "fp8")
    fp8_checkpoint(save_tiny(tmp_path / "base", "qwen3_moe"), fp8)
    key = "model.layers.1.self_attn.k_proj.weight"
    if damage == "scale_missing":
        tensors = load_file(os.path.join(fp8, "model.safetensors"))
        del tensors[key + "_scale_inv"]
        save_file(tensors, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
        expected = f"{key} is stored in fp8 without {key}_scale_inv"
    else:
        config = json.loads((tmp_path / "fp8" / "config.json").read_text())
        del config["quantization_config"]
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
        expected = "is stored in fp8, but config.json has no quantization_config"
    with pytest.raises(CheckpointError, match=expected.replace(".", r"\.")):
        check_source_dir(fp8)  # what moe-tune checks before anything is built or written (exit 2)
    with pytest.raises(CheckpointError, match=expected.replace(".", r"\.")):
        from_pretrained(fp8)  # and the reader itself


@pytest.mark.parametrize("damage", ["config_block_larger", "config_block_smaller", "stale_scale"])
def test_scales_that_cannot_be_the_weights_blocks_are_refused_by_name(tmp_path, damage):
    """Scales made for another weight_block_size than config.json says (coarser or finer), or left beside a weight
    that is no longer fp8 (a checkpoint dequantized in part), stop the check and the reader naming the tensor:
    before, the first trained on weights up to 40% off, the second crashed, the third scaled bf16 weights again."""
    from moe_tune.build import from_pretrained

    fp8 = str(tmp_path / "fp8")
    fp8_checkpoint(
        save_tiny(tmp_path / "base", "qwen3_moe"), fp8, [32, 32] if damage == "config_block_smaller" else BLOCK
    )
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    key = "model.layers.0.self_attn.q_proj.weight"
    if damage == "stale_scale":
        tensors = load_file(os.path.join(fp8, "model.safetensors"))
        tensors[key] = _dequantized(tensors[key], tensors[key + "_scale_inv"]).bfloat16()
        save_file(tensors, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
        expected = f"{key} is stored in BF16, not fp8, yet has {key}_scale_inv"
    else:
        config["quantization_config"]["weight_block_size"] = [128, 128] if damage == "config_block_larger" else [8, 8]
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
        expected = "_scale_inv has shape .* needs"
    with pytest.raises(CheckpointError, match=expected):
        check_source_dir(fp8)
    with pytest.raises(CheckpointError, match=expected):
        from_pretrained(fp8)
