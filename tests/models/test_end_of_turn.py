"""Exports stop generating where the chat template ends an assistant turn (models/generation.stop_at_end_of_turn)."""

import json
import os

import pytest
import torch

from moe_tune.models.generation import stop_at_end_of_turn
from moe_tune.models.presets import build_tiny_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    return build_tiny_checkpoint(str(tmp_path / "tiny"))


def _eos(path) -> object:
    with open(f"{path}/generation_config.json") as f:
        return json.load(f)["eos_token_id"]


def _new_tokens(path) -> int:
    """Tokens generate() produces (of at most 6) when the model is forced to answer <|im_end|> first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True)
    ids = torch.tensor([prompt["input_ids"] if hasattr(prompt, "keys") else prompt])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(ids, max_new_tokens=6, do_sample=False, prefix_allowed_tokens_fn=lambda *_: [end])
    return out.shape[1] - ids.shape[1]


def test_generation_stops_at_the_templates_end_of_turn(checkpoint):
    """The built-in ChatML template closes turns with <|im_end|> while the tokenizer's eos is <eos>: before,
    generate() ran past a forced <|im_end|> to its limit; after, it stops there. A second call changes nothing."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("<|im_end|>")
    assert _eos(checkpoint) == 2 and _new_tokens(checkpoint) == 6
    stop_at_end_of_turn(checkpoint)
    assert _eos(checkpoint) == [2, end] and _new_tokens(checkpoint) == 1
    stop_at_end_of_turn(checkpoint)
    assert _eos(checkpoint) == [2, end]


@pytest.mark.parametrize(
    "template",
    [None, "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}", "{{ raise_exception('no') }}"],
    ids=["no_template", "ends_with_eos", "template_raises"],
)
def test_nothing_to_add_leaves_the_generation_config(checkpoint, template):
    """No template, a template whose turns end with eos already, or one that refuses the probe chat: untouched."""
    config = f"{checkpoint}/tokenizer_config.json"
    with open(config) as f:
        settings = json.load(f)
    settings.pop("chat_template", None)
    if template is not None:
        settings["chat_template"] = template
    with open(config, "w") as f:
        json.dump(settings, f)
    jinja = f"{checkpoint}/chat_template.jinja"
    if os.path.exists(jinja):
        os.remove(jinja)
    before = open(f"{checkpoint}/generation_config.json").read()
    stop_at_end_of_turn(checkpoint)
    assert open(f"{checkpoint}/generation_config.json").read() == before


@pytest.mark.parametrize("base_has_generation_config", [True, False], ids=["base_config", "no_base_config"])
def test_a_lora_adapter_directory_stops_at_the_end_of_turn(checkpoint, tmp_path, base_has_generation_config):
    """A LoRA run's hf/ holds the base's tokenizer and a generation config that stops at <|im_end|> (made from the
    base's config.json when the base has none): PEFT's model generates with it and stops at a forced <|im_end|>."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from moe_tune.build import from_pretrained
    from moe_tune.lora import LoRASpec
    from moe_tune.models.peft_export import write_adapter

    if not base_has_generation_config:
        os.remove(f"{checkpoint}/generation_config.json")
    adapter = str(tmp_path / "adapter")
    write_adapter(from_pretrained(checkpoint, lora=LoRASpec(rank=8, targets=("attention", "experts"))), adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)  # the tokenizer came along
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in _eos(adapter) and tokenizer.eos_token_id in _eos(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True)
    ids = torch.tensor([prompt["input_ids"] if hasattr(prompt, "keys") else prompt])
    out = model.generate(
        input_ids=ids,
        generation_config=GenerationConfig.from_pretrained(adapter),
        max_new_tokens=6,
        do_sample=False,
        prefix_allowed_tokens_fn=lambda *_: [end],
    )
    assert out.shape[1] - ids.shape[1] == 1
