"""A model source that cannot be trained is one line before anything is written: a sharded checkpoint whose index
is malformed, names a missing shard or a shard outside ``model.path``; a config.json field of the wrong type or
size; ``model.overrides`` with a typo, a size below 1 or more experts per token than experts; a seed torch cannot
take; an output_dir this process cannot write."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from moe_tune.config import CheckpointError, ConfigError
from moe_tune.models.hf_io import CheckpointReader
from moe_tune.models.source_check import check_overrides, check_source_dir
from tests.harness import FAST_RUN, run_main


@pytest.fixture
def sharded(tmp_path, tiny_checkpoint):
    """A tiny checkpoint saved in shards with an index (as a hub download of a large model is)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).save_pretrained(
        out, max_shard_size="60KB"
    )
    assert len(list(out.glob("*.safetensors"))) > 2
    return out


def _index(path) -> tuple[str, dict]:
    file = os.path.join(path, "model.safetensors.index.json")
    return file, json.load(open(file))


def test_an_intact_sharded_checkpoint_passes(sharded):
    check_source_dir(str(sharded))
    reader = CheckpointReader(str(sharded))
    assert set(reader.weight_map.values()) == {p.name for p in sharded.glob("*.safetensors")}


def test_a_missing_shard_is_named(sharded):
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    for check in (check_source_dir, CheckpointReader):
        with pytest.raises(CheckpointError, match=f"names {shard.name}, which .* does not hold"):
            check(str(sharded))


def test_a_malformed_index_is_named(sharded):
    file, _ = _index(sharded)
    with open(file, "w") as f:
        f.write('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a valid index"):
        check_source_dir(str(sharded))


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_an_index_pointing_outside_the_directory_is_refused(sharded, tmp_path, where):
    """Weights read from elsewhere would train silently on another checkpoint's tensors."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(sharded, elsewhere)
    file, index = _index(sharded)
    key, shard = next(iter(index["weight_map"].items()))
    index["weight_map"][key] = str(elsewhere / shard) if where == "absolute" else f"../elsewhere/{shard}"
    json.dump(index, open(file, "w"))
    for check in (check_source_dir, CheckpointReader):
        with pytest.raises(CheckpointError, match="shards must be file names inside"):
            check(str(sharded))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", "big", "hidden_size='big' must be a whole number >= 1"),
        ("num_hidden_layers", 0, "num_hidden_layers=0 must be a whole number >= 1"),
        ("num_experts_per_tok", 9, "num_experts_per_tok=9 is more than the model's 8 experts"),
        ("rms_norm_eps", "tiny", "transformers cannot read it"),
        # transformers' layers divide by it: a ZeroDivisionError traceback after output_dir was made
        ("decoder_sparse_step", 0, "decoder_sparse_step=0 must be a whole number >= 1"),
    ],
)
def test_a_bad_config_json_field_is_one_line(tiny_checkpoint, field, value, message):
    path = tiny_checkpoint()
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    cfg[field] = value
    json.dump(cfg, open(file, "w"))
    with pytest.raises((CheckpointError, ConfigError), match=message) as e:
        check_source_dir(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_expert_per_tok": 2}, "no field num_expert_per_tok; did you mean model.overrides.num_experts_per_tok"),
        ({"hidden_size": -8}, "model.overrides.hidden_size=-8 must be a whole number >= 1"),
        ({"num_hidden_layers": 0}, "model.overrides.num_hidden_layers=0 must be a whole number >= 1"),
        ({"num_experts_per_tok": 64}, "num_experts_per_tok=64 is more than the model's 8 experts"),
    ],
)
def test_bad_model_overrides_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_overrides("tiny_qwen3_moe", overrides)


def test_a_qwen2_moe_without_shared_expert_is_one_line_before_output_dir_exists(tiny_checkpoint, tmp_path):
    """shared_expert_intermediate_size=0, which transformers builds and saves (a zero-wide shared expert, its
    weights of no elements): refused naming the value and the fix, exit 2, nothing written. It was told the
    checkpoint held 'tensors the model does not use' (those empty weights), as if config.json did not match them."""
    path = tiny_checkpoint("qwen2_moe", shared_expert_intermediate_size=0)
    out = tmp_path / "run"
    r = _cli(["model=hf", f"model.path={path}", f"output_dir={out}", "train.steps=1"])
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert f"{path}/config.json: shared_expert_intermediate_size=0 (a Qwen2-MoE without a shared expert)" in line
    assert "give a Qwen2-MoE checkpoint with a shared expert" in line and "does not use" not in line, line
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"shared_expert_intermediate_size=0 .* drop the override \(the preset's is"):
        check_overrides("qwen2_moe_a2_7b", {"shared_expert_intermediate_size": 0})
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=-1 must be a whole number >= 1"):
        check_overrides("qwen2_moe_a2_7b", {"shared_expert_intermediate_size": -1})


def test_good_model_overrides_pass():
    check_overrides("tiny_qwen3_moe", {"num_hidden_layers": 3, "num_experts_per_tok": 8, "num_experts": 8})


def _cli(args: list[str]):
    """``moe-tune args`` (in this process: harness.run_main)."""
    return run_main(args)


def test_a_missing_shard_and_a_huge_seed_stop_before_output_dir_exists(sharded, tmp_path):
    next(iter(sharded.glob("*-00002-*.safetensors"))).unlink()
    for args in ([f"model.path={sharded}"], ["train.seed=99999999999999999999"]):
        out = tmp_path / "run"
        r = _cli([*args, f"output_dir={out}", "train.steps=1"])
        assert r.returncode == 2, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="needs Linux's /proc")
def test_an_output_dir_without_write_permission_is_one_line(tmp_path):
    """A directory this process cannot write: /proc/1 (not writable even by root, who writes anywhere else), or a
    directory without write permission where the suite does not run as root."""
    parent = "/proc/1"
    if os.geteuid() != 0:
        parent = str(tmp_path / "locked")
        os.mkdir(parent, 0o555)
    r = _cli([f"output_dir={parent}/run", "train.steps=1"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"moe-tune: error: output_dir={parent}/run (under {parent}) is not writable (a read-only file system or no "
        "permission); give an output_dir you can write to"
    ]


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="needs Linux's /proc")
def test_an_output_dir_where_nothing_can_be_created_is_one_line(monkeypatch):
    """/proc/x: os.access tells root that /proc is writable (its permission bits), yet no mkdir succeeds there (as
    under /sys, or a read-only FUSE mount). os.access says so here for any user, as it does to root."""
    from moe_tune.train import lock

    monkeypatch.setattr(lock.os, "access", lambda path, mode: True)
    with pytest.raises(ConfigError) as e:
        lock.check_output_dir("/proc/x")
    assert str(e.value).startswith("output_dir=/proc/x (under /proc) is not writable (creating an entry there fails: ")
    assert str(e.value).endswith("; give an output_dir you can write to")


def test_the_output_dir_probe_leaves_nothing(tmp_path):
    from moe_tune.train.lock import check_output_dir

    check_output_dir(str(tmp_path / "new" / "run"))
    check_output_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/proc/1"), reason="needs root and Linux's /proc")
def test_output_dir_under_proc_as_root_is_one_line_and_exit_2():
    r = _cli(["output_dir=/proc/x", "train.steps=1", *FAST_RUN])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-tune: error: output_dir=/proc/x (under /proc) is not "), lines
    assert not os.path.exists("/proc/x")


def _garble_header(file) -> None:
    """Overwrite the safetensors header's length (its first 8 bytes) with one far past the file's end."""
    with open(file, "r+b") as f:
        f.write(b"\xff" * 8)


def test_a_garbled_safetensors_header_is_a_checkpoint_error_naming_the_file(tiny_checkpoint):
    path = tiny_checkpoint()
    file = os.path.join(path, "model.safetensors")
    _garble_header(file)
    with pytest.raises(CheckpointError, match="is not a readable safetensors file") as e:
        CheckpointReader(path)
    assert file in str(e.value) and "\n" not in str(e.value)


def test_a_run_whose_base_model_was_damaged_resumes_to_one_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    base = [f"output_dir={run}", "checkpoint.export_hf=false", "checkpoint.every=2", *FAST_RUN]
    r = run_main([*base, "train.steps=2"])
    assert r.returncode == 0, r.stderr[-4000:]
    file = run / "base_model" / "model.safetensors"
    _garble_header(file)
    r = run_main([*base, "train.steps=4"])
    assert r.returncode == 2, r.stderr[-4000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"moe-tune: error: {file} is not a readable safetensors file"), r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "restore it" in lines[-1]


def test_one_experts_tensor_of_another_shape_is_named_before_output_dir_exists(tiny_checkpoint, tmp_path):
    """A layer's per-expert tensors are stacked into one: an expert whose tensor has another shape (a damaged
    file, shards of two models) is named from the headers, exit 2 with one line, before anything is written. It
    ended in torch.stack's RuntimeError traceback (exit 1) as the model loaded."""
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint(num_hidden_layers=1, hidden_size=64, moe_intermediate_size=32)  # dims NF4 blocks
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    odd = "model.layers.0.mlp.experts.5.down_proj.weight"
    tensors[odd] = tensors[odd][:, :16].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{odd} has shape \\(64, 16\\) where the layer's other experts'"):
        check_source_dir(path)
    out = tmp_path / "run"
    r = _cli([f"model.path={path}", "peft=lora", "peft.quantize_base=nf4", f"output_dir={out}", *FAST_RUN])
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and odd in r.stderr, r.stderr[-2000:]
    assert not out.exists()
