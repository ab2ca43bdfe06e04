"""A run's model source and run files: an earlier ``base_model/`` built for other ``model.overrides`` is rebuilt,
not silently used; a run that fails on its input leaves an earlier ``config.json`` as it was."""

from __future__ import annotations

import json
import os

import torch

from moe_tune.build import build_source
from moe_tune.cli.train import compose, to_config
from moe_tune.models.presets import build_tiny_checkpoint
from tests.harness import run_main


def test_a_base_model_of_other_overrides_is_rebuilt(tmp_path, caplog):
    build_tiny_checkpoint(str(tmp_path / "base_model"), overrides={"num_hidden_layers": 4})
    cfg = to_config(compose([f"output_dir={tmp_path}", "+model.overrides.num_hidden_layers=2"]))
    with caplog.at_level("WARNING", logger="moe_tune"):
        path, hf_config = build_source(cfg, rank=0)
    assert hf_config.num_hidden_layers == 2
    assert json.load(open(tmp_path / "base_model" / "config.json"))["num_hidden_layers"] == 2
    assert "num_hidden_layers: 4 -> 2" in caplog.text and "rebuilding it" in caplog.text


def test_a_base_model_drawn_with_another_seed_is_rebuilt(tmp_path, caplog):
    """A fresh run with another train.seed in an output_dir whose base_model/ was drawn with the first: the base is
    drawn again with the new seed, the same weights as the same command gives in an empty output_dir (it reused the
    first seed's weights, so the command's result depended on what the directory held)."""
    from safetensors.torch import load_file

    def base(out, seed):
        cfg = to_config(compose([f"output_dir={out}", f"train.seed={seed}"]))
        return load_file(os.path.join(build_source(cfg, rank=0)[0], "model.safetensors"))

    base(tmp_path / "a", 0)
    with caplog.at_level("WARNING", logger="moe_tune"):
        again = base(tmp_path / "a", 1)
    fresh = base(tmp_path / "b", 1)
    assert "train.seed: 0 -> 1" in caplog.text and "rebuilding it" in caplog.text
    assert again.keys() == fresh.keys() and all(torch.equal(again[k], fresh[k]) for k in fresh)


def test_an_unchanged_base_model_is_reused(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path / "base_model"), overrides={"num_hidden_layers": 2})
    (tmp_path / "base_model" / "marker").write_text("kept")
    cfg = to_config(compose([f"output_dir={tmp_path}", "+model.overrides.num_hidden_layers=2"]))
    assert build_source(cfg, rank=0)[0] == path
    assert (tmp_path / "base_model" / "marker").read_text() == "kept"


def test_a_failed_run_leaves_config_json_as_it_was(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"earlier": "run"}')
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{broken\n')
    args = [f"output_dir={run}", f"data.path={data}", "train.steps=1", "train.seq_len=64", "train.precision=fp32"]
    r = run_main(args)
    assert r.returncode == 2 and f"{data}:2" in r.stderr, r.stderr[-3000:]
    assert (run / "config.json").read_text() == '{"earlier": "run"}'


def _tree_digest(root) -> dict[str, str]:
    """Every file and directory under ``root``: relative path -> sha256 of its bytes ("dir" for a directory)."""
    import hashlib

    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
    }


def test_a_run_refused_in_a_used_output_dir_leaves_it_as_it_was(tmp_path):
    """Another preset into an output_dir whose checkpoint it cannot resume is refused (exit 2) once the model is
    known, after it rebuilt base_model/ for its own settings: the earlier run's base_model/ (its checkpoints'
    base) comes back, byte for byte, and nothing else changes. A run that starts keeps the base it built."""
    run = tmp_path / "run"
    common = [f"output_dir={run}", "train.seq_len=64", "train.micro_batch_size=2", "data.num_samples=64"]
    r = run_main([*common, "train.steps=1", "checkpoint.every=1", "train.precision=fp32"])
    assert r.returncode == 0, r.stderr[-3000:]
    before = _tree_digest(run)
    other = ["model=tiny_deepseek_v3", "train.steps=2", "train.precision=fp32"]
    r = run_main([*common, *other])
    assert r.returncode == 2 and "does not match the model" in r.stderr, r.stderr[-3000:]
    assert "rebuilding it" in r.stderr  # the refusal came after the rebuild it undid
    assert _tree_digest(run) == before

    r = run_main([*common, *other, "checkpoint.resume=none", "checkpoint.every=0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "base_model" / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert not [name for name in os.listdir(run) if name.startswith(".base_model")]


def _checkpoint_without(tmp_path, *names, vocab_size=None):
    """The tiny checkpoint (its own 102-token tokenizer) with some tokenizer files removed, or a smaller
    vocab_size in config.json."""
    import shutil

    src = build_tiny_checkpoint(str(tmp_path / "src"))
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    if vocab_size is not None:
        config = json.loads((dst / "config.json").read_text())
        config["vocab_size"] = vocab_size
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _check(dst, *overrides):
    from moe_tune.build import check_model_source

    check_model_source(to_config(compose(["model=hf", f"model.path={dst}", *overrides])))


def test_a_tokenizer_json_alone_is_the_tokenizer(tmp_path):
    """Without tokenizer_config.json, the checkpoint's tokenizer.json was ignored and the user's records were
    tokenized by the built-in tokenizer, silently."""
    from moe_tune.build import build_tokenizer

    dst = _checkpoint_without(tmp_path, "tokenizer_config.json")
    (dst / "tokenizer.json").write_text((dst / "tokenizer.json").read_text().replace('"<unk>"', '"<UNK>"'))
    assert "<UNK>" in build_tokenizer(str(dst)).get_vocab()


def test_user_records_need_the_checkpoints_tokenizer(tmp_path):
    """No tokenizer files: the user's records are refused (one line naming the fix); built-in data is read by the
    built-in tokenizer (the run warns); random token ids need none."""
    import pytest

    from moe_tune.config import ConfigError

    dst = _checkpoint_without(tmp_path, "tokenizer_config.json", "tokenizer.json")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="has no tokenizer .*copy the checkpoint's tokenizer files into it"):
        _check(dst, f"data.path={tmp_path / 'd.jsonl'}")
    _check(dst, "data=arithmetic")
    _check(dst, "data=random")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    """Token ids past the embedding crashed mid-run (an index error after the lock and config.json were written);
    random token ids are drawn below vocab_size and pass."""
    import pytest

    from moe_tune.config import ConfigError

    dst = _checkpoint_without(tmp_path, vocab_size=64)
    with pytest.raises(ConfigError, match=r"its tokenizer has 102 tokens but the model's vocab_size is 64; resize"):
        _check(dst, "data=arithmetic")
    _check(dst, "data=random")
