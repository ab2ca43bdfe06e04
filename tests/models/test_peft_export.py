"""LoRA exports against PEFT and transformers (fp32, CPU): the PEFT adapter directory that ``peft.PeftModel``
loads onto the plain transformers model, and the merged export that transformers loads alone, both give
moe_tune's logits within TOL. Adapters on every kind of target (attention, dense MLP and shared experts, routed
experts; trained routers as PEFT's modules_to_save), with B drawn nonzero so that every adapter counts."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import VOCAB, save_tiny

peft = pytest.importorskip("peft", reason="the PEFT round trip needs peft (in the dev extra)")

TOL = 1e-5
# The merged export rounds each W + scale * B @ A to fp32 once, where PEFT and moe_tune add the delta to the
# activations; measured up to 1.5e-5 on logits of magnitude ~4 (DeepSeek-V3 with a trained router, transformers 5.24),
# the others below 1e-5; the adapters themselves move them by more than 100 x TOL (asserted below).
MERGED_TOL = 5e-5
# Families with dense MLPs or shared experts get adapters there too (peft.target=mlp names nothing elsewhere).
WITH_MLP = {"deepseek_v3", "qwen2_moe", "glm4_moe"}


def _targets(family: str) -> tuple[str, ...]:
    return ("attention", "mlp", "experts") if family in WITH_MLP else ("attention", "experts")


def _lora_model(src: str, **spec):
    from moe_tune.build import from_pretrained
    from moe_tune.lora import LoRASpec

    model = from_pretrained(src, lora=LoRASpec(rank=8, **spec))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters (and routers): B = 0 would hide a wrong B layout
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("train_router", [False, True], ids=["router_frozen", "router_trained"])
def test_peft_adapter_and_merged_export_give_our_logits(tmp_path, family, train_router):
    from moe_tune.models.lora import merge_lora
    from moe_tune.models.peft_export import write_adapter

    src = save_tiny(tmp_path / "base", family)
    model = _lora_model(src, targets=_targets(family), train_router=train_router)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = model(ids).logits
    base = _hf(src)
    assert (base(input_ids=ids).logits - ours).abs().max() > 100 * TOL  # the adapters change the model

    write_adapter(model, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] and config["target_modules"]
    if family in WITH_MLP:  # the dense MLP's and shared experts' linears, as PEFT parameter targets
        assert any(p.endswith("mlp.gate_proj.weight") for p in config["target_parameters"]), config
    assert bool(config["modules_to_save"]) == train_router
    peft_logits = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(input_ids=ids).logits
    assert (peft_logits - ours).abs().max() <= TOL

    merge_lora(model)
    assert not any(".lora." in n for n, _ in model.named_parameters())
    model.save_pretrained(str(tmp_path / "merged"))
    merged = _hf(str(tmp_path / "merged"))(input_ids=ids).logits
    assert (merged - ours).abs().max() <= MERGED_TOL


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "gpt_oss", "glm4_moe"])
def test_peft_adapter_of_the_other_families(tmp_path, family):
    """GPT-OSS keeps its experts as [E, in, out] with interleaved gate/up: the same A and B describe them."""
    from moe_tune.models.peft_export import write_adapter

    src = save_tiny(tmp_path / "base", family)
    model = _lora_model(src, targets=_targets(family))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    write_adapter(model, str(tmp_path / "adapter"))
    peft_model = peft.PeftModel.from_pretrained(_hf(src), str(tmp_path / "adapter")).eval()
    assert (peft_model(input_ids=ids).logits - model(ids).logits).abs().max() <= TOL


def test_a_target_that_names_no_linear_is_a_config_error(tmp_path):
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "qwen3_moe")
    with pytest.raises(ConfigError, match=r"peft.target names 'qkv_proj'.*q_proj"):
        _lora_model(src, targets=("attention", "qkv_proj"))


def test_a_target_word_that_adapts_nothing_is_a_config_error(tmp_path):
    """Qwen3-MoE has no dense MLP or shared expert: peft.target=[attention,mlp] would silently adapt attention
    only (and [mlp] alone nothing at all)."""
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "qwen3_moe")
    with pytest.raises(ConfigError, match=r"peft.target names mlp, but this qwen3_moe model has no such linear"):
        _lora_model(src, targets=("attention", "mlp"))
