"""``moe-tune-export``: a training checkpoint to a Hugging Face directory; bad input exits 2."""

import subprocess

import pytest
import torch

from tests.harness import FAST_RUN, PY, assert_hf_logits_equal, read_hf_tensors, run_cli


@pytest.mark.dist
def test_export_cli_from_ep2_checkpoint(tmp_path, cli_env):
    """moe-tune-export of an EP=2 checkpoint (2 ranks) equals the run's own hf/ export, bit for bit."""
    run_cli(
        [f"output_dir={tmp_path}", "train.steps=2", "checkpoint.every=2", "parallel.ep=2", *FAST_RUN], cli_env, nproc=2
    )
    out = tmp_path / "exported"
    r = subprocess.run(
        [PY, "-m", "moe_tune.export_cli", str(tmp_path / "checkpoints" / "step_2"), str(out)],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_hf_logits_equal(str(out))


def test_export_cli_bad_input_exits_2(tmp_path, cli_env):
    r = subprocess.run(
        [PY, "-m", "moe_tune.export_cli", str(tmp_path), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=cli_env,
    )
    assert r.returncode == 2 and "not a complete moe-tune checkpoint" in r.stderr
