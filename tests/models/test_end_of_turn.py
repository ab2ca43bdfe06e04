"""Exports stop generating where the chat template ends an assistant turn (models/export.stop_at_end_of_turn)."""

import json
import os

import pytest
import torch

from moe_tune.models.export import stop_at_end_of_turn
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
