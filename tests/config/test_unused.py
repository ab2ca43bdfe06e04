"""Settings accepted but changing nothing in the run get a line each in its log (a new user's trial found each of
these silently ignored)."""

import pytest

from moe_tune.config.overrides import compose, to_config
from moe_tune.config.unused import unused_settings


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.eval_every=1"], "train.eval_every=1 has no validation set to evaluate"),
        (["train.steps=8"], "optim.warmup_steps=10 is more than train.steps=8: the learning rate never reaches"),
        (
            ["train.steps=3", "optim.warmup_steps=0"],
            "train.warmup_steps_excluded=3 leaves no step of train.steps=3 to time: summary.json's medians take every",
        ),
        (["peft=lora", "train.aux_loss_coef=0.5"], "train.aux_loss_coef=0.5 changes nothing with peft=lora"),
        (["peft=lora", "train.z_loss_coef=0.1"], "train.z_loss_coef=0.1 changes nothing with peft=lora"),
        (["logger.expert_load_image_every=1"], "logger.expert_load_image_every=1 draws images for a tracker"),
        (["kernels.quantized_base=triton"], "peft=none keeps them in bf16; add peft=lora peft.quantize_base=fp8"),
        (
            ["peft=lora", "kernels.quantized_base=triton"],
            "quantize_base=none keeps them in bf16; add peft.quantize_base=",
        ),
        (
            ["peft=lora", "peft.quantize_base=nf4", "kernels.experts=loop"],
            "kernels.experts=loop with peft.quantize_base=nf4 runs the reference loop over fp32 copies",
        ),
    ],
)
def test_each_unused_setting_is_named(overrides, expected):
    lines = unused_settings(to_config(compose(["train.steps=20", *overrides])))
    assert len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train.eval_every=1", "data.val_fraction=0.1"],
        ["train.steps=10"],
        ["peft=lora", "peft.train_router=true", "train.aux_loss_coef=0.5"],
        ["peft=lora"],
        ["logger=tensorboard", "logger.expert_load_image_every=1"],
        ["peft=lora", "peft.quantize_base=nf4", "kernels.quantized_base=triton"],
        ["kernels.experts=loop"],
    ],
)
def test_used_settings_say_nothing(overrides):
    assert unused_settings(to_config(compose(["train.steps=20", *overrides]))) == []


def test_a_cuda_kernel_on_the_cpu_is_named():
    """The Triton GEMMs of a quantized base exist on CUDA only: on the CPU the run says what it does instead."""
    overrides = ["train.steps=20", "peft=lora", "peft.quantize_base=nf4", "kernels.quantized_base=triton"]
    lines = unused_settings(to_config(compose(overrides)), device_type="cpu")
    assert lines == [
        "kernels.quantized_base=triton is a CUDA kernel; on the cpu the quantized experts are dequantized and "
        "multiplied in PyTorch"
    ]


def test_an_fp8_base_on_the_cpu_says_it_is_emulated():
    """An FP8 base trains on the CPU through the kernel's emulation (tests, small models): the log says so."""
    cfg = to_config(compose(["train.steps=20", "peft=lora", "peft.quantize_base=fp8"]))
    assert unused_settings(cfg) == []  # on a GPU: nothing to say
    assert unused_settings(cfg, device_type="cpu") == [
        "peft.quantize_base=fp8 on the cpu emulates the FP8 GEMMs (the same E4M3 values, multiplied in fp32): the "
        "numbers and the memory of FP8, far slower; its kernel needs an sm90 GPU (H100, H200)"
    ]


@pytest.mark.parametrize(
    "mode, ep, world, said",
    [
        ("nf4", 1, 8, "holds each rank's experts quantized whole on 8 ranks (more than a bf16 base sharded over them)"),
        ("nf4", 4, 8, "holds each rank's experts quantized whole on 2 ranks (less saved)"),
        ("fp8", 2, 4, "on 2 ranks (more than a bf16 base sharded over them); parallel.ep=4 holds the least"),
        ("nf4", 8, 8, None),
    ],
)
def test_quantized_experts_held_on_several_ranks_are_named(mode, ep, world, said):
    """FSDP2 shards bf16 experts over the ranks of an expert shard group; quantized ones are whole on each."""
    cfg = to_config(compose(["train.steps=20", "peft=lora", f"peft.quantize_base={mode}", f"parallel.ep={ep}"]))
    lines = unused_settings(cfg, world_size=world)
    assert lines == ([] if said is None else [lines[0]]) and (said is None or said in lines[0]), lines


@pytest.mark.parametrize("mode", ["fp8", "nf4"])
def test_a_quantized_base_of_a_model_without_routed_experts_is_named(mode):
    """A MoE family's config whose layers are all dense (Qwen3-MoE's mlp_only_layers) has no routed experts to
    quantize: the run's log said its frozen routed experts were held in that mode."""
    cfg = to_config(compose(["train.steps=20", "peft=lora", "peft.target=[attention]", f"peft.quantize_base={mode}"]))
    assert unused_settings(cfg, routed_experts=True) == []
    assert unused_settings(cfg, routed_experts=False) == [
        f"peft.quantize_base={mode} quantizes the routed experts, and this model has none (no MoE layer): every "
        "weight stays as stored; drop peft.quantize_base"
    ]


def test_validation_on_the_training_records_is_named(tmp_path, monkeypatch):
    """data.val_path naming data.path's file (here through a link) measures val_loss on the training records: the
    run says so; another file says nothing."""
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "latest.jsonl").symlink_to(tmp_path / "train.jsonl")
    (tmp_path / "val.jsonl").write_text('{"text": "b"}\n')
    monkeypatch.chdir(tmp_path)
    given = ["train.steps=20", "data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", "train.eval_every=5"]
    lines = unused_settings(to_config(compose([*given, "data.val_path=latest.jsonl"])))
    assert len(lines) == 1 and "val_loss is measured on the training records" in lines[0], lines
    assert unused_settings(to_config(compose([*given, "data.val_path=val.jsonl"]))) == []
