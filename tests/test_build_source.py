"""A run's model source and run files: an earlier ``base_model/`` built for other ``model.overrides`` is rebuilt,
not silently used; a run that fails on its input leaves an earlier ``config.json`` as it was."""

from __future__ import annotations

import json
import subprocess

from moe_tune.build import build_source
from moe_tune.cli import compose, to_config
from moe_tune.models.presets import build_tiny_checkpoint
from tests.harness import PY


def test_a_base_model_of_other_overrides_is_rebuilt(tmp_path, caplog):
    build_tiny_checkpoint(str(tmp_path / "base_model"), overrides={"num_hidden_layers": 4})
    cfg = to_config(compose([f"output_dir={tmp_path}", "+model.overrides.num_hidden_layers=2"]))
    with caplog.at_level("WARNING", logger="moe_tune"):
        path, hf_config = build_source(cfg, rank=0)
    assert hf_config.num_hidden_layers == 2
    assert json.load(open(tmp_path / "base_model" / "config.json"))["num_hidden_layers"] == 2
    assert "num_hidden_layers: 4 -> 2" in caplog.text and "rebuilding it" in caplog.text


def test_an_unchanged_base_model_is_reused(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path / "base_model"), overrides={"num_hidden_layers": 2})
    (tmp_path / "base_model" / "marker").write_text("kept")
    cfg = to_config(compose([f"output_dir={tmp_path}", "+model.overrides.num_hidden_layers=2"]))
    assert build_source(cfg, rank=0)[0] == path
    assert (tmp_path / "base_model" / "marker").read_text() == "kept"


def test_a_failed_run_leaves_config_json_as_it_was(tmp_path, cli_env):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"earlier": "run"}')
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{broken\n')
    args = [f"output_dir={run}", f"data.path={data}", "train.steps=1", "train.seq_len=64", "train.precision=fp32"]
    r = subprocess.run([PY, "-m", "moe_tune", *args], capture_output=True, text=True, env=cli_env, timeout=300)
    assert r.returncode == 2 and f"{data}:2" in r.stderr, r.stderr[-3000:]
    assert (run / "config.json").read_text() == '{"earlier": "run"}'
