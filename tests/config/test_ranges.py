"""Every bad input of issue 17's list is exit 2 with one line naming the value (or file:line) and the fix, before
any process group exists or anything is written: the output directory is not even created.

The table runs through the CLI's own path in this process (``precheck``, then ``run`` of the composed config);
two cases also run ``python -m moe_tune`` in a subprocess, for the exit code and the absence of a traceback."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from moe_tune.cli import train as cli
from moe_tune.models.source_check import check_safetensors_header
from tests.harness import PY

# override -> what the one error line says
CASES = {
    "optim.min_lr_ratio=-2": "optim.min_lr_ratio=-2.0 is out of range: it must be in [0, 1]",
    "checkpoint.every=-1": "checkpoint.every=-1 is out of range: it must be >= 0",
    "optim.warmup_steps=-5": "optim.warmup_steps=-5 is out of range: it must be >= 0",
    "train.lr=-1": "train.lr=-1.0 is out of range: it must be > 0",
    "optim.betas=[2,3]": "optim.betas=[2.0,3.0] is out of range: it must be two values in [0, 1)",
    "optim.eps=-1": "optim.eps=-1.0 is out of range: it must be > 0",
    "train.log_every=0": "train.log_every=0 is out of range: it must be >= 1",
    "data.num_samples=0": "data.num_samples=0 is out of range: it must be >= 1",
    "kernels.loss_chunk_size=0": "kernels.loss_chunk_size=0 is out of range: it must be >= 1",
    "+model.overrides.num_hidden_layers=abc": "model.overrides.num_hidden_layers='abc' must be a int",
    "train.steps=abc": "train.steps='abc' is not an integer",
    "optim.max_grad_norm=-1": "optim.max_grad_norm=-1.0 is out of range: it must be >= 0",
    "train.global_batch_size=0": "train.global_batch_size=0 is out of range",
}


def exit_of(overrides: list[str], capsys) -> tuple[int, str]:
    """What ``moe-tune <overrides>`` exits with and prints, up to where Hydra would take over."""
    capsys.readouterr()  # what the test printed before (a fixture's progress bars)
    with pytest.raises(SystemExit) as e:
        cli.precheck(overrides)
        cli.run(cli.compose(overrides))
    return e.value.code, capsys.readouterr().err


def assert_one_line_exit_2(code: int, err: str, expected: str, out_dir) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-tune: error: "), err
    assert expected in lines[0], err
    assert "try " in lines[0] or "give " in lines[0] or "fix " in lines[0] or "copy " in lines[0], err
    assert not os.path.exists(out_dir), os.listdir(out_dir)


@pytest.mark.parametrize("override", list(CASES))
def test_bad_value_is_one_line_exit_2_and_nothing_written(override, tmp_path, capsys, no_launcher):
    out = tmp_path / "run"
    code, err = exit_of([override, f"output_dir={out}"], capsys)
    assert_one_line_exit_2(code, err, CASES[override], out)


def _corrupt(kind: str, path: str) -> str:
    """Damage a Hugging Face directory one way; returns what the error line must say."""
    weights, config = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    if kind == "truncated_header":
        with open(weights, "r+b") as f:
            f.truncate(20)
        return "model.safetensors: header length"
    if kind == "truncated_data":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 100)
        return "but its header lists"
    if kind == "garbage_header":
        with open(weights, "r+b") as f:
            f.seek(8)
            f.write(b"\xff\xfe garbage")
        return "the safetensors header is not valid JSON"
    if kind == "bad_json":
        with open(config, "w") as f:
            f.write('{\n  "model_type": "qwen3_moe",\n  oops\n}\n')
        return "config.json:3:3: not valid JSON"
    cfg = json.load(open(config))
    del cfg["model_type"]
    json.dump(cfg, open(config, "w"))
    return "config.json has no model_type"


@pytest.mark.parametrize(
    "kind", ["truncated_header", "truncated_data", "garbage_header", "bad_json", "missing_model_type"]
)
def test_bad_model_files_are_one_line_exit_2(kind, tiny_checkpoint, tmp_path, capsys, no_launcher):
    src = tiny_checkpoint(num_hidden_layers=1)
    expected = _corrupt(kind, src)
    out = tmp_path / "run"
    code, err = exit_of([f"model.path={src}", f"output_dir={out}"], capsys)
    assert_one_line_exit_2(code, err, expected, out)


def test_an_intact_safetensors_header_passes(tiny_checkpoint):
    check_safetensors_header(os.path.join(tiny_checkpoint(num_hidden_layers=1), "model.safetensors"))


@pytest.mark.parametrize("override", ["optim.min_lr_ratio=-2", "train.steps=abc"])
@pytest.mark.slow
def test_the_command_exits_2_without_traceback(override, tmp_path, cli_env):
    out = tmp_path / "run"
    r = subprocess.run(
        [PY, "-m", "moe_tune", override, f"output_dir={out}"], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert CASES[override] in r.stderr
    assert not out.exists()
