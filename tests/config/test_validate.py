"""Every file in conf/ composes and validates; every validation error has its message (the CLI's exit 2 and one
line: tests/cli/test_train.py)."""

import os
import re

import pytest

from moe_tune.cli.train import CONF_DIR, compose, to_config
from moe_tune.config import Config, ConfigError, validate
from moe_tune.env import require_backends
from tests.harness import ROOT

GROUP_OPTIONS = [
    (group, name[: -len(".yaml")])
    for group in sorted(os.listdir(CONF_DIR))
    if os.path.isdir(os.path.join(CONF_DIR, group))
    for name in sorted(os.listdir(os.path.join(CONF_DIR, group)))
    if name.endswith(".yaml")
]
NEEDS = {  # options that need a value the user must supply, or hardware this machine lacks
    ("model", "hf"): ["model.path=" + ROOT],
    ("data", "jsonl"): ["data.path=" + os.path.join(ROOT, "pyproject.toml")],
}


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_conf_file_composes(group, option):
    overrides = [f"{group}={option}"] + NEEDS.get((group, option), [])
    cfg = to_config(compose(overrides))
    assert isinstance(cfg, Config)
    if group == "experiment":
        world = cfg.parallel.ep * max(cfg.parallel.dp_replicate, 1)
        validate_without_backends(cfg, world)
    elif (group, option) in {("comm", "deepep"), ("comm", "symm_mem"), ("kernels", "te"), ("model", "hf")}:
        with pytest.raises(ConfigError):  # not usable on this CPU machine, or path lacks config.json
            validate(cfg, world_size=2)
            require_backends(cfg)
    else:
        validate(cfg, world_size=1)


def validate_without_backends(cfg, world):
    cfg.comm.name = "all_to_all"
    cfg.kernels.name = "torch"
    validate(cfg, world_size=world)


def test_default_values():
    cfg = to_config(compose([]))
    assert cfg.model.name == "tiny_qwen3_moe" and cfg.comm.name == "all_to_all" and cfg.kernels.name == "torch"
    assert cfg.train.precision == "bf16_fp32_master" and cfg.parallel.ep == 1


def test_overlap_validates_for_all_to_all():
    cfg = to_config(compose(["comm.overlap=true", "parallel.ep=2"]))
    assert cfg.comm.overlap and validate(cfg, world_size=2).ep == 2


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.precision=amp_bf16"],  # autocast runs the grouped GEMMs in bf16
        ["train.precision=fp32", "kernels.experts=loop"],
        # The frozen experts' GEMMs are opaque custom ops, and no adapter of theirs calls grouped_mm.
        ["train.precision=fp32", "peft=lora", "peft.quantize_base=fp8", "peft.target=[attention]"],
    ],
)
def test_compiled_runs_without_fp32_grouped_gemms_validate(overrides):
    validate(to_config(compose(["kernels.compile=true", *overrides])), world_size=1)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.ep=3"], 4, "parallel.ep (3) must divide parallel.dp_shard (4"),
        (["parallel.ep=2"], 1, "parallel.ep (2) must divide parallel.dp_shard (1"),
        (["parallel.dp_replicate=3"], 4, "parallel.dp_replicate (3) must divide the world size (4)"),
        (["parallel.dp_shard=3"], 4, "parallel.dp_replicate (1) x parallel.dp_shard (3) must equal the world size (4)"),
        (["comm=deepep"], 1, "comm=deepep needs expert parallelism"),
        (
            ["comm=deepep", "comm.overlap=true", "parallel.ep=2"],
            2,
            "comm.overlap=true is implemented for comm=all_to_all only, not comm=deepep; set comm.overlap=false",
        ),
        (
            ["comm=symm_mem", "comm.overlap=true", "parallel.ep=2"],
            2,
            "comm.overlap=true is implemented for comm=all_to_all only, not comm=symm_mem; set comm.overlap=false",
        ),
        (["comm.overlap=true"], 1, "comm.overlap=true hides expert-parallel communication and parallel.ep=1 has none"),
        (["kernels.fp8=current"], 1, "kernels.fp8=current needs kernels=te"),
        (["kernels=te", "kernels.experts=te"], 1, "kernels.experts=te is not offered"),
        (["kernels=te", "kernels.compile=true"], 1, "kernels=te with kernels.compile=true is not supported"),
        # torch's fake kernel of grouped_mm takes bf16 only: compiled, fp32 expert GEMMs fail at the first step.
        (
            ["train.precision=fp32", "kernels.compile=true"],
            1,
            "kernels.compile=true with train.precision=fp32 runs grouped GEMMs in fp32 (in the experts), which "
            "torch.compile cannot trace",
        ),
        (
            ["train.precision=fp32", "kernels.compile=true", "peft=lora", "peft.quantize_base=nf4"],
            1,
            "(in the LoRA adapters of the experts)",
        ),
        (["train.profile=true", "train.steps=8"], 1, "train.profile=true traces steps 7-9"),
        (["kernels.fp8_amax_compute_algo=mean"], 1, "kernels.fp8_amax_compute_algo='mean' is not one of max"),
        (["kernels.fp8=true"], 1, "kernels.fp8=true is not one of none, current, delayed, blockwise, mxfp8; pick"),
        (["kernels.fp8_amax_history_len=0"], 1, "kernels.fp8_amax_history_len=0 is out of range: it must be >= 1"),
        (
            ["kernels=te", "kernels.fp8=current", "kernels.fp8_amax_history_len=16"],
            1,
            "kernels.fp8_amax_history_len (16) / kernels.fp8_amax_compute_algo (max) apply to kernels.fp8=delayed only",
        ),
        (
            ["kernels=te", "kernels.fp8=delayed", "kernels.fp8_backward=high_precision"],
            1,
            "kernels.fp8_backward=high_precision needs kernels.fp8=current, blockwise or mxfp8 (got kernels.fp8=delayed",
        ),
        (
            ["optim.stochastic_rounding=true"],
            1,
            "optim.stochastic_rounding=true rounds bf16 parameters (got train.precision=bf16_fp32_master",
        ),
        (["train.max_nonfinite_steps=-1"], 1, "train.max_nonfinite_steps=-1 is out of range: it must be >= 0"),
        (
            ["peft.rank=8"],
            1,
            "peft.rank applies to LoRA (peft=lora), and peft=none trains every weight: add peft=lora, or drop "
            "peft.rank=8",
        ),
        (["peft.quantize_base=fp8"], 1, "peft.quantize_base applies to LoRA (peft=lora), and peft=none trains every"),
        (["peft=lora", "peft.quantize_base=int4"], 1, "peft.quantize_base='int4' is not one of none, fp8, nf4; pick"),
        (["peft=lora", "peft.quantize_base=NF4"], 1, "not one of none, fp8, nf4; did you mean peft.quantize_base=nf4?"),
        (["kernels.experts=Grouped-MM"], 1, "did you mean kernels.experts=grouped_mm?"),
        # The storage given to the GEMMs' key and the other way round: pointed to the key that takes it.
        (
            ["peft=lora", "kernels.quantized_base=nf4"],
            1,
            "kernels.quantized_base='nf4' is not one of torch, triton; nf4 is the frozen experts' storage under LoRA "
            "(peft.quantize_base): did you mean peft.quantize_base=nf4?",
        ),
        (["peft=lora", "peft.quantize_base=triton"], 1, "did you mean kernels.quantized_base=triton?"),
        (
            ["peft=lora", "peft.quantize_base=nf4", "kernels.experts=grouped_mm_fp8"],
            1,
            "kernels.experts=grouped_mm_fp8 quantizes trained expert weights at every step; with "
            "peft.quantize_base=nf4 the frozen experts are quantized once",
        ),
        (
            ["peft.target=[attention]", "peft.alpha=8"],
            1,
            "peft.alpha, peft.target apply to LoRA (peft=lora), and peft=none trains every weight: add peft=lora, or "
            "drop peft.alpha=8.0, peft.target=[attention]",
        ),
        (["checkpoint.keep_last=-1"], 1, "checkpoint.keep_last=-1 is out of range"),
        (["kernels.fp8_format=e5m2"], 1, "kernels.fp8_format='e5m2' is not one of hybrid, e4m3"),
        (
            ["kernels=te", "kernels.fp8_format=e4m3"],
            1,
            "kernels.fp8_format=e4m3 needs an FP8 recipe (got kernels.fp8=none)",
        ),
        (["kernels.fp8_backward=bf16"], 1, "kernels.fp8_backward='bf16' is not one of fp8, high_precision"),
        (
            ["kernels=te", "kernels.fp8=delayed", "kernels.fp8_fprop_split_accumulator=true"],
            1,
            "kernels.fp8_fprop_split_accumulator=true applies to kernels.fp8=current only (got kernels.fp8=delayed",
        ),
        (
            ["kernels=te", "kernels.fp8=blockwise", "train.seq_len=100", "train.micro_batch_size=1"],
            1,
            "(1 x 100 = 100) must be a multiple of 128; try train.seq_len=128",
        ),
        (["train.precision=fp16"], 1, "train.precision='fp16' is not one of"),
        (["parallel.activation_checkpointing=some"], 1, "parallel.activation_checkpointing='some'"),
        (["model.path=/nonexistent"], 1, "model.path=/nonexistent does not exist; moe_tune reads local checkpoints"),
        (
            ["train.global_batch_size=6", "train.micro_batch_size=4"],
            1,
            "train.global_batch_size (6) must be a multiple",
        ),
        (["train.steps=0"], 1, "train.steps=0 is out of range: it must be >= 1 (optimizer steps); try train.steps=60"),
        (["train.log_every=0"], 1, "train.log_every=0 is out of range: it must be >= 1"),
        (["optim.schedule=linear"], 1, "optim.schedule='linear' is not one of cosine, constant"),
        (["data.name=wiki"], 1, "data='wiki' is not built in (arithmetic, random)"),
        # data=jsonl without a path: what is missing, not data.num_samples' range (which it fails too).
        (["data=jsonl"], 1, "data=jsonl reads your records from data.path, which is not set; add data.path=<file"),
        (
            ["data=arithmetic", "data.path=/x.jsonl"],
            1,
            "data=arithmetic generates its records and reads no data.path (/x.jsonl); for your records write "
            "data=jsonl data.path=/x.jsonl (or data.path alone)",
        ),
        (["checkpoint.resume=/nonexistent/step_5"], 1, "checkpoint.resume=/nonexistent/step_5 does not exist"),
        # Refused before the model is built (the loader found it after).
        (
            ["data=jsonl", "data.path=/x.jsonl", "data.streaming=true", "data.val_fraction=0.1"],
            1,
            "data.val_fraction (0.1) splits records held in memory; with data.streaming=true give the held-out",
        ),
    ],
)
def test_validation_errors(overrides, world, message):
    cfg = to_config(compose(overrides))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_experts_not_divisible_by_ep():
    cfg = to_config(compose(["parallel.ep=8"]))
    with pytest.raises(
        ConfigError, match=r"number of experts \(60\) must be divisible by parallel.ep \(8\); try parallel.ep=4"
    ):
        validate(cfg, world_size=8, num_experts=60)


def test_a_chat_template_file_that_is_no_template_is_named(tmp_path):
    """data.chat_template naming a tokenizer_config.json, a data file (JSON Lines), a file with a Jinja syntax error
    or an empty one: the run rendered the JSON as text and blamed the first record ('no token carries loss ... raise
    train.seq_len'), or blamed each record for the template's syntax (every one skipped under
    data.on_bad_record=skip). One line naming the file; a template that compiles passes."""
    files = {
        "tokenizer_config.json": '{"chat_template": "{{ messages }}", "eos_token": "<eos>"}',
        "broken.jinja": "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
        "empty.jinja": "\n",
        "chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "x"}\n',
        "good.jinja": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    }
    said = {
        "tokenizer_config.json": "is a JSON file, not a Jinja template (its chat_template holds one: write that",
        "broken.jinja": "broken.jinja:2: not a valid Jinja template (unexpected '}')",
        "empty.jinja": "empty.jinja is empty; give a Jinja chat template file",
        "chat.jsonl": "chat.jsonl holds no Jinja tag ({{ ... }} or {% ... %}); give a Jinja chat template file",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        cfg = Config()
        cfg.data.name, cfg.data.path, cfg.data.chat_template = "jsonl", ROOT, str(tmp_path / name)
        if name in said:
            with pytest.raises(ConfigError, match=re.escape(said[name])):
                validate(cfg, world_size=1)
        else:
            validate(cfg, world_size=1)
