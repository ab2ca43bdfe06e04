"""LoRA exports against PEFT and transformers (fp32, CPU), for every family: the PEFT adapter directory that
``peft.PeftModel`` loads onto the plain transformers model, the model with the adapters merged into its weights
(``merge_lora``, GPT-OSS's [experts, in, out] experts included), and that merged model exported for transformers
alone, all give moe_tune's logits within LORA_TOL. Adapters on every kind of target (attention, dense MLP and
shared experts, routed experts; trained routers as PEFT's modules_to_save), with B drawn nonzero so that every
adapter counts."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.tiny import FAMILIES, LORA_TOL, VOCAB, rel_err, save_tiny

peft = pytest.importorskip("peft", reason="the PEFT round trip needs peft (in the dev extra)")

# Families with dense MLPs or shared experts get adapters there too (peft.target=mlp names nothing elsewhere).
WITH_MLP = {"deepseek_v3", "qwen2_moe", "glm4_moe"}
# No size of the tiny models (tests/tiny.py), so a transposed A or B cannot pass; a multiple of 8, as LoRA on the
# experts' grouped GEMMs takes.
RANK = 72


def _targets(family: str) -> tuple[str, ...]:
    return ("attention", "mlp", "experts") if family in WITH_MLP else ("attention", "experts")


def _lora_model(src: str, **spec):
    from moe_tune.build import from_pretrained
    from moe_tune.lora import LoRASpec

    model = from_pretrained(src, lora=LoRASpec(rank=RANK, **spec))
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
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_router", [False, True], ids=["router_frozen", "router_trained"])
def test_peft_adapter_and_merged_model_give_our_logits(tmp_path, family, train_router):
    from moe_tune.models.lora import merge_lora
    from moe_tune.models.peft_export import write_adapter

    src = save_tiny(tmp_path / "base", family)
    model = _lora_model(src, targets=_targets(family), train_router=train_router)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = model(ids).logits
    base = _hf(src)
    assert rel_err(base(input_ids=ids).logits, ours) > 1e4 * LORA_TOL  # the adapters change the model

    write_adapter(model, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] and config["target_modules"]
    if family in WITH_MLP:  # the dense MLP's and shared experts' linears, as PEFT parameter targets
        assert any(p.endswith(".gate_proj.weight") for p in config["target_parameters"]), config
    assert bool(config["modules_to_save"]) == train_router
    peft_logits = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(input_ids=ids).logits
    assert rel_err(peft_logits, ours) < LORA_TOL

    merged = copy.deepcopy(model)
    merge_lora(merged)
    assert not any(".lora." in n for n, _ in merged.named_parameters())
    assert rel_err(merged(ids).logits, ours) < LORA_TOL
    merged.save_pretrained(str(tmp_path / "merged"))
    assert rel_err(_hf(str(tmp_path / "merged"))(input_ids=ids).logits, ours) < LORA_TOL


def test_a_target_that_names_no_linear_is_a_config_error(tmp_path):
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "qwen3_moe")
    with pytest.raises(ConfigError, match=r"peft.target names 'qkv_proj'.*q_proj"):
        _lora_model(src, targets=("attention", "qkv_proj"))


@pytest.mark.parametrize("target", ["shared_expert_gate", "gate"])
def test_a_target_naming_a_gate_says_gates_take_no_adapter(tmp_path, target):
    """Qwen2-MoE's router (``mlp.gate``) and shared expert's gate are linears left without adapters: naming one is
    a ConfigError saying so, not that the model has no such linear."""
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "qwen2_moe")
    with pytest.raises(ConfigError, match=rf"peft.target names '{target}', a router or a shared expert's gate"):
        _lora_model(src, targets=("attention", target))


@pytest.mark.parametrize("target, where", [("lm_head", ""), ("embed_tokens", " (model.embed_tokens)")])
def test_a_target_naming_the_head_or_embeddings_says_they_stay_frozen(tmp_path, target, where):
    """PEFT users' ``lm_head`` and ``embed_tokens`` are outside the decoder layers, where adapters go: the line says
    so and how to train them, not that the model has no such linear (its head is one)."""
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "mixtral", tie_word_embeddings=True)
    with pytest.raises(ConfigError) as e:
        _lora_model(src, targets=("attention", target))
    assert str(e.value) == (
        f"peft.target names {target!r}{where}, which is outside the decoder layers: adapters go on their linears "
        f"only, and the embeddings and head stay frozen under peft=lora; drop {target!r} from peft.target "
        "(peft=none trains every weight)"
    )


def test_a_target_word_that_adapts_nothing_is_a_config_error(tmp_path):
    """Qwen3-MoE has no dense MLP or shared expert: peft.target=[attention,mlp] would silently adapt attention
    only (and [mlp] alone nothing at all)."""
    from moe_tune.config import ConfigError

    src = save_tiny(tmp_path / "base", "qwen3_moe")
    with pytest.raises(ConfigError, match=r"peft.target names mlp, but this qwen3_moe model has no such linear"):
        _lora_model(src, targets=("attention", "mlp"))


@torch.no_grad()
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_frozen_router_whose_correction_bias_moved_is_saved_whole(tmp_path, family):
    """Aux-loss-free balancing (train.bias_update_rate) moves a frozen router's e_score_correction_bias: the
    adapter directory saves that router whole (modules_to_save), so that PEFT's model routes as moe_tune's does;
    a router whose bias stayed the source's is not saved."""
    from moe_tune.models.peft_export import write_adapter
    from moe_tune.moe.layer import MoE

    src = save_tiny(tmp_path / "base", family, num_hidden_layers=3)
    model = _lora_model(src, targets=_targets(family))
    moved, kept = [m for m in model.modules() if isinstance(m, MoE)]
    moved.router.e_score_correction_bias.add_(torch.linspace(-0.5, 0.5, moved.router.e_score_correction_bias.numel()))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = model(ids).logits

    write_adapter(model, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == [f"model.layers.{moved.layer_idx}.mlp.gate"], config["modules_to_save"]
    peft_logits = peft.PeftModel.from_pretrained(_hf(src), str(tmp_path / "adapter")).eval()(input_ids=ids).logits
    assert rel_err(peft_logits, ours) < LORA_TOL


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_bf16_model_on_an_fp32_base_holds_its_frozen_routers_as_the_files_do(tmp_path, family):
    """``build.from_checkpoint`` of a ``train.precision=bf16`` LoRA run builds a bf16 model whose frozen base is held
    as its files hold it (``base_dtype``: fp32 here). The frozen routers too: rounded to bf16 they would route
    otherwise than the base PEFT loads the adapters onto, and ``moe-tune-export --merge`` would write them over the
    base's. DeepSeek-V3's router is an fp32 island of its own."""
    from safetensors.torch import load_file

    from moe_tune.build import from_pretrained
    from moe_tune.lora import LoRASpec
    from moe_tune.models.lora import merge_lora
    from moe_tune.moe.layer import MoE

    src = save_tiny(tmp_path / "base", family)
    lora = LoRASpec(rank=8, targets=_targets(family), base_dtype=torch.float32)
    model = from_pretrained(src, dtype=torch.bfloat16, lora=lora)
    assert {p.dtype for n, p in model.named_parameters() if ".lora." in n} == {torch.bfloat16}
    merge_lora(model)
    model.save_pretrained(str(tmp_path / "merged"))
    source, merged = load_file(f"{src}/model.safetensors"), load_file(f"{tmp_path}/merged/model.safetensors")
    gates = [f"model.layers.{m.layer_idx}.mlp.gate.weight" for m in model.modules() if isinstance(m, MoE)]
    assert gates and all(torch.equal(merged[k], source[k]) for k in gates), gates
