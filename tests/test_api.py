"""The Python API as docs/python-api.md shows it (issue 18, item 8): ``out.logits`` with labels whenever no backward
can follow (eval mode, torch.no_grad()), and None in a training forward, where the fused loss never builds them."""

import pytest
import torch

import moe_tune


def test_logits_with_labels_outside_training_none_in_training(tiny_checkpoint):
    model = moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32, kernels="torch")
    ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    out = model(input_ids=ids, labels=ids)
    plain = model(input_ids=ids).logits
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    # The loss is still the fused one; over these logits it is plain cross-entropy of the shifted labels.
    ref = torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, plain.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).logits, plain, rtol=0, atol=0)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and out.loss.requires_grad  # training: no batch x seq x vocab tensor
    assert model(input_ids=ids, labels=ids, return_logits=True).logits is not None
    model.eval()
    assert model(input_ids=ids, labels=ids, return_logits=False).logits is None


def test_a_training_forward_without_the_fused_loss_returns_the_logits_its_loss_used(tiny_checkpoint):
    """loss_chunk_size=None computes the loss from full logits: a training forward returns them, as transformers."""
    model = moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32, loss_chunk_size=None)
    ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model.train()(input_ids=ids, labels=ids)
    assert out.logits is not None and out.logits.shape == (*ids.shape, model.config.vocab_size)
    ref = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    assert model(input_ids=ids, labels=ids, return_logits=False).logits is None


def test_the_contracts_snippet_gives_the_loss_and_transformers_logits(tiny_checkpoint):
    """CONTRACT.md's three lines as written: from_pretrained returns the model in eval mode, as transformers does,
    so ``model(input_ids=ids, labels=ids)`` gives ``out.loss`` and ``out.logits``, transformers' own (1e-5)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint()
    model = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, kernels="torch")
    assert not model.training
    ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_readme_from_checkpoint_runs_as_written_after_import_moe_tune(tmp_path, cli_env):
    """docs/lora.md's ``moe_tune.build.from_checkpoint(...)`` after a plain ``import moe_tune`` (new-user trial: an
    AttributeError, moe_tune had no attribute build). ``import moe_tune`` still loads neither torch nor build."""
    import re
    import subprocess

    from tests.harness import FAST_RUN, PY, ROOT, run_cli

    page = open(f"{ROOT}/docs/lora.md").read()
    snippet = re.search(r"`(model, cfg = moe_tune\.build\.from_checkpoint\(\"outputs/run/[^`]*)`", page).group(1)
    run_cli([f"output_dir={tmp_path / 'outputs' / 'run'}", "train.steps=1", "checkpoint.every=1", *FAST_RUN], cli_env)
    code = (
        "import sys\nimport moe_tune\nassert 'torch' not in sys.modules and 'moe_tune.build' not in sys.modules\n"
        f"{snippet.replace('step_N', 'step_1')}\nprint(type(model).__name__, cfg.train.steps)"
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=cli_env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["MoECausalLM", "1"], r.stderr[-2000:]


def test_a_float64_model_on_the_loop_of_experts_gives_transformers_logits(tiny_checkpoint):
    """The dtype the grouped GEMMs refuse runs on the per-expert loop, as the refusal says: transformers' float64
    logits but for the router's fp32 island (measured 2e-7)."""
    from moe_tune.moe.experts import ExpertsOptions
    from tests.tiny import load_hf, rel_err

    path = tiny_checkpoint()
    model = moe_tune.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts=ExpertsOptions(impl="loop")
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.dtype == torch.float64
        assert rel_err(logits, load_hf(path, torch.float64)(input_ids=ids).logits) < 1e-5


def test_from_checkpoint_returns_the_model_in_eval_mode_as_from_pretrained(tmp_path):
    """It came in training mode: the adapters' dropout made two forwards of one input differ, and a forward with
    labels gave no logits."""
    from tests.harness import FAST_RUN, train_run

    lora = ["peft=lora", "peft.rank=8", "peft.dropout=0.5", "peft.target=[attention]"]
    train_run([f"output_dir={tmp_path}", *lora, "train.steps=1", "checkpoint.every=1", *FAST_RUN])
    model, _ = moe_tune.build.from_checkpoint(str(tmp_path / "checkpoints" / "step_1"))
    assert not model.training
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model(ids, labels=ids).logits is not None


def test_lora_spec_names_a_keyword_that_is_no_field():
    """LoRASpec(target=...) (the CLI's peft.target) was Python's bare 'unexpected keyword argument'."""
    from moe_tune.lora import LoRASpec

    with pytest.raises(TypeError, match="LoRASpec has no field 'target'; did you mean targets=...?"):
        LoRASpec(target=("attention",))
    assert LoRASpec(8, targets=("attention",)).rank == 8  # positional and keyword fields still build it


@pytest.mark.parametrize(
    "kwargs,words",
    [
        # A misspelt kernels built the plain torch model without a word.
        ({"kernels": "tritonn"}, "kernels='tritonn' is not one of torch, te"),
        ({"kernels": "TE"}, "kernels='TE' is not one of torch, te; did you mean kernels='te'?"),
        ({"dtype": "bf16"}, "dtype='bf16' is not a floating-point torch dtype; give torch.bfloat16 or 'bfloat16'"),
        ({"dtype": "int8"}, "dtype='int8' is not a floating-point torch dtype"),
        # float64 built, then failed in its first forward with torch's "Expected mat_a to be Float32, ...".
        (
            {"dtype": torch.float64},
            "impl='grouped_mm': the grouped GEMMs take float32, bfloat16 or float16, not float64; use "
            "experts=moe_tune.moe.experts.ExpertsOptions(impl='loop')",
        ),
        # An FP8 dtype was refused for its dims with impl='loop' as the fix, where torch found no Float8 storage.
        ({"dtype": torch.float8_e4m3fn}, "dtype=torch.float8_e4m3fn is a storage format, not a model dtype; give"),
        # transformers' older name: a TypeError from an internal dataclass.
        ({"torch_dtype": torch.bfloat16}, "torch_dtype is transformers' older name of dtype: give dtype="),
        ({"aux_loss_coeff": 0.01}, "aux_loss_coeff is not an option of the model; did you mean aux_loss_coef?"),
        # -1 ran no loss chunk: a training loss of 0 (plus the aux loss), no error.
        ({"loss_chunk_size": -1}, "loss_chunk_size=-1 must be an integer >= 1 (kernels.loss_chunk_size) or None"),
        ({"loss_chunk_size": 0}, "loss_chunk_size=0 must be an integer >= 1"),
        ({"loss_chunk_size": 512.0}, "loss_chunk_size=512.0 must be an integer >= 1"),
        # A negative or NaN coefficient: "stack expects a non-empty TensorList" at the first training forward.
        ({"aux_loss_coef": -0.01}, "aux_loss_coef=-0.01 must be a finite number >= 0 (train.aux_loss_coef)"),
        ({"z_loss_coef": float("nan")}, "z_loss_coef=nan must be a finite number >= 0 (train.z_loss_coef)"),
        ({"z_loss_coef": None}, "z_loss_coef=None must be a finite number >= 0"),
        # transformers' bitsandbytes arguments: the list of options alone named no fix.
        (
            {"load_in_4bit": True},
            "load_in_4bit is transformers' argument for a bitsandbytes base; moe_tune holds the frozen routed experts "
            "quantized under LoRA: give experts=moe_tune.moe.experts.ExpertsOptions(quantized_base='nf4') and "
            "lora=moe_tune.lora.LoRASpec(...)",
        ),
        ({"load_in_8bit": True}, "ExpertsOptions(quantized_base='fp8') and lora="),
        # transformers-style dicts in place of moe_tune's option classes: an AttributeError while building.
        (
            {"lora": {"rank": 8}},
            "lora={'rank': 8} is not LoRASpec(...): give lora=moe_tune.lora.LoRASpec(rank=8), or "
            "lora=None (full fine-tuning)",
        ),
        (
            {"experts": {"quantized_base": "nf4"}},
            "experts={'quantized_base': 'nf4'} is not ExpertsOptions(...): give "
            "experts=moe_tune.moe.experts.ExpertsOptions(quantized_base='nf4')",
        ),
        ({"experts": None}, "experts=None is not ExpertsOptions(...): give experts=moe_tune.moe.experts."),
        # A field of LoRASpec or ExpertsOptions given flat (the CLI's spelling too): the list of options alone.
        (
            {"quantized_base": "nf4"},
            "quantized_base is not an option of the model; ExpertsOptions takes it: give "
            "experts=moe_tune.moe.experts.ExpertsOptions(quantized_base='nf4')",
        ),
        ({"quantize_base": "fp8"}, "ExpertsOptions takes it as quantized_base: give experts="),
        (
            {"rank": 8},
            "rank is not an option of the model; LoRASpec takes it: give lora=moe_tune.lora.LoRASpec(rank=8)",
        ),
        ({"target": ("attention",)}, "LoRASpec takes it as targets: give lora=moe_tune.lora.LoRASpec(targets="),
        # kernels='torch' has no FP8 modules: an FP8 recipe, known or not, built the full-precision model unsaid.
        (
            {"fp8": "current"},
            "fp8='current' is TransformerEngine's FP8 recipe (kernels.fp8) and needs kernels='te' (got "
            "kernels='torch', which has no FP8 modules); add kernels='te' or drop fp8",
        ),
        ({"fp8": "Delayed", "kernels": "te"}, "fp8='Delayed' is not one of 'none', 'current', 'delayed', 'blockwise'"),
        ({"fp8_options": {"margin": 1}}, "fp8_options={'margin': 1} apply to an FP8 recipe and fp8='none'; give fp8="),
        # Any truthy value forced balanced routing, "false" too.
        ({"force_balanced_routing": "false"}, "force_balanced_routing='false' is not a bool; give "),
        ({"packed_attention": 1}, "packed_attention=1 is not a bool; give packed_attention=True or"),
    ],
)
def test_from_pretrained_names_a_bad_argument_and_its_fix(kwargs, words, tiny_checkpoint):
    from moe_tune.config import ConfigError

    with pytest.raises(ConfigError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), **kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        # rank 0 was a ZeroDivisionError, a negative one torch's "negative dimension" while building the model.
        ({"rank": 0}, "LoRASpec(rank=0): rank must be an integer >= 1 (peft.rank); try rank=16"),
        ({"rank": -4}, "LoRASpec(rank=-4): rank must be an integer >= 1"),
        ({"alpha": 0}, "LoRASpec(alpha=0): alpha must be a number > 0 (peft.alpha)"),
        ({"dropout": 1.5}, "LoRASpec(dropout=1.5): dropout must be a number in [0, 1) (peft.dropout)"),
        # A bare string was read letter by letter: "peft.target names 'a', which is no linear of this model".
        (
            {"targets": "attention"},
            "LoRASpec(targets='attention'): targets is a tuple of names; write targets=('attention',)",
        ),
        # No target built a model with nothing to train, and save_pretrained wrote it whole (no adapters).
        ({"targets": ()}, "LoRASpec(targets=()): targets names what LoRA adapts (peft.target), words or linear"),
        # A string: TypeError "'>' not supported between instances of 'str' and 'int'".
        ({"alpha": "16"}, "LoRASpec(alpha='16'): alpha must be a number > 0 (peft.alpha); try alpha=32.0"),
        ({"dropout": None}, "LoRASpec(dropout=None): dropout must be a number in [0, 1) (peft.dropout)"),
        # Any truthy value trained the routers, "no" too.
        ({"train_router": "no"}, "LoRASpec(train_router='no') is not a bool; give train_router=True or False"),
        # int8 cast the frozen weights to integers (a dtype error at the first forward); a name failed as a device.
        ({"base_dtype": torch.int8}, "LoRASpec(base_dtype=torch.int8): the frozen base is stored in a floating-"),
        ({"base_dtype": "bfloat16"}, "LoRASpec(base_dtype='bfloat16'): the frozen base is stored in a floating-"),
    ],
)
def test_lora_spec_names_a_bad_value_and_its_fix(kwargs, words):
    from moe_tune.config import ConfigError
    from moe_tune.lora import LoRASpec

    with pytest.raises(ConfigError) as e:
        LoRASpec(**kwargs)
    assert words in str(e.value)


def test_from_pretrained_refuses_a_lora_rank_the_experts_grouped_gemms_cannot_take(tiny_checkpoint):
    """As moe-tune refuses peft.rank=4 with peft.target including experts; the reference loop takes any rank."""
    from moe_tune.config import ConfigError
    from moe_tune.lora import LoRASpec
    from moe_tune.moe.experts import ExpertsOptions

    with pytest.raises(ConfigError, match=r"LoRASpec\(rank=4\) with experts .* multiple of 8.*try rank=8"):
        moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), lora=LoRASpec(rank=4))
    moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), lora=LoRASpec(rank=4, targets=("attention",)))
    loop = ExpertsOptions(impl="loop")
    moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), lora=LoRASpec(rank=4), experts=loop)


@pytest.mark.parametrize(
    "top_k, words", [(0, "must be a whole number >= 1"), (9, "is more than the model's 8 experts")]
)
def test_from_pretrained_checks_config_json_as_moe_tune_does(tiny_checkpoint, top_k, words):
    """A config.json that contradicts itself is refused at load, naming the field, as the CLI refuses it; it loaded,
    and the first forward failed inside the router ("selected index k out of range")."""
    import json
    import os

    from moe_tune.config import ConfigError

    path = tiny_checkpoint()
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg["num_experts_per_tok"] = top_k
    with open(file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match=f"num_experts_per_tok={top_k} {words}"):
        moe_tune.AutoModelForCausalLM.from_pretrained(path)


def test_from_checkpoint_of_a_path_that_does_not_exist_says_so(tmp_path):
    """A checkpoint path that is not there is named as missing, not as an incomplete checkpoint (whose fix, its
    meta.json and COMPLETE, would send the user looking for files in a directory that does not exist)."""
    from moe_tune.build import from_checkpoint
    from moe_tune.config import CheckpointError

    gone = tmp_path / "run" / "checkpoints" / "step_5"
    with pytest.raises(CheckpointError) as e:
        from_checkpoint(str(gone))
    assert str(e.value) == f"checkpoint {gone} does not exist; give a run's checkpoints/step_<N> directory"
