"""Loading a checkpoint never runs code from it: a ``.metadata`` (or a non-tensor entry, or TE extra state) whose
unpickling would call ``os.system`` is refused, exit 2 naming the file, and its payload never runs, on
``checkpoint.resume=auto`` and on ``moe-tune-export``."""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest
import torch

from moe_tune.checkpoint import safe
from moe_tune.config import CheckpointError
from tests.harness import FAST_RUN, PY, CheckpointRun, cli_env, run_main, train_run


class _Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(checkpoint: str, marker: str) -> None:
    """A crafted ``.metadata``, and COMPLETE as an older moe-tune wrote it (no manifest to disagree with it)."""
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with open(os.path.join(checkpoint, "COMPLETE"), "w") as f:
        f.write("2")


@pytest.mark.slow
def test_malicious_metadata_is_refused_on_resume_and_export(tmp_path):
    out = tmp_path / "run"
    train_run([f"output_dir={out}", "train.steps=2", "checkpoint.every=2", "checkpoint.export_hf=false", *FAST_RUN])
    checkpoint = str(out / "checkpoints" / "step_2")
    marker = tmp_path / "payload_ran"
    _plant(checkpoint, str(marker))
    args = [f"output_dir={out}", "train.steps=4", "checkpoint.export_hf=false", *FAST_RUN]
    resumed = run_main(args)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    line = resumed.stderr.strip().splitlines()[-1]
    assert "refusing to load" in line and os.path.join(checkpoint, ".metadata") in line and "posix.system" in line
    # A process of its own: it warns once about the old COMPLETE (this process has warned about that path already).
    export = subprocess.run(
        [PY, "-m", "moe_tune.cli.export", checkpoint, str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    assert export.returncode == 2, export.stderr[-3000:]
    line = export.stderr.strip().splitlines()[-1]  # after one warning: an old COMPLETE, nothing to check
    assert line.startswith("moe-tune-export: error: refusing to load") and os.path.join(checkpoint, ".metadata") in line
    assert len(export.stderr.strip().splitlines()) == 2
    assert not marker.exists()  # the payload never ran


def test_a_non_tensor_entry_is_read_weights_only(tmp_path):
    """DCP reads a non-tensor entry with ``torch.load(weights_only=False)``; a crafted one is refused here."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "payload_ran"
    dcp.save({"w": torch.ones(2), "extra": _Payload(str(marker))}, checkpoint_id=str(tmp_path / "c"))
    state = {"w": torch.zeros(2), "extra": None}
    with pytest.raises(BaseException, match="Weights only load failed"):  # DCP's CheckpointException wraps it
        safe.dcp_load(state, str(tmp_path / "c"))
    assert not marker.exists()


def test_a_shard_outside_the_checkpoint_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path))
    metadata = safe.read_metadata(str(tmp_path))
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(safe.UnsafeCheckpoint, match="outside the checkpoint directory"):
        safe.read_metadata(str(tmp_path))


class _TELike(torch.nn.Module):
    """Extra state as TransformerEngine keeps it: a pickle in a uint8 tensor."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(self.state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        self.loaded = state


def _trainer(tmp_path, state):
    from moe_tune.config import Config
    from moe_tune.models.model import build_model, materialize
    from moe_tune.models.presets import preset_config

    model = build_model(preset_config("tiny_qwen3_moe", {"num_hidden_layers": 1}, vocab_size=64))
    materialize(model, "cpu")
    model.model.layers[0].te_like = _TELike(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return CheckpointRun(model=model, optimizer=opt, scheduler=sched, step=1, cfg=Config())


def test_te_extra_state_is_screened_before_te_may_unpickle_it(tmp_path):
    marker = tmp_path / "payload_ran"
    benign = {"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 3}}
    _trainer(tmp_path, benign).save(str(tmp_path / "good"))
    _trainer(tmp_path, None).load(str(tmp_path / "good"))  # tensors and containers pass
    _trainer(tmp_path, {"recipe": _Payload(str(marker))}).save(str(tmp_path / "bad"))
    with pytest.raises(CheckpointError, match=r"extra_state.rank0.pt .*posix.system is not allowed"):
        _trainer(tmp_path, None).load(str(tmp_path / "bad"))
    assert not marker.exists()
