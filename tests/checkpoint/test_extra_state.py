"""Modules with ``get_extra_state`` (TransformerEngine's keep FP8 scaling history there as a pickled uint8 tensor
whose length changes once FP8 runs) must not break saving or resuming a checkpoint."""

from __future__ import annotations

import os

import torch

from moe_tune.config import Config
from moe_tune.models.init import init_random
from moe_tune.models.model import build_model, materialize
from moe_tune.models.presets import preset_config
from tests.harness import CheckpointRun


class _ExtraState(torch.nn.Module):
    """Like a TE module: its extra state is a uint8 tensor whose size depends on what has run."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes = nbytes

    def get_extra_state(self) -> torch.Tensor:
        return torch.arange(self.nbytes, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        self.loaded = state
        # TE >= 2.20 unpickles delayed-scaling state only with this opt-in (else resume raises).
        self.pickle_opt_in = os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")


def _trainer(seed: int, nbytes: int):
    model = build_model(preset_config("tiny_qwen3_moe", {"num_hidden_layers": 1}, vocab_size=64))
    materialize(model, "cpu")
    init_random(model, seed=seed, num_experts=model.num_experts)
    model.model.layers[0].te_like = _ExtraState(nbytes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return CheckpointRun(model=model, optimizer=opt, scheduler=sched, step=3, cfg=Config())


def test_checkpoint_with_variable_size_extra_state_saves_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "0")  # a user's setting, kept outside the load
    saved = _trainer(seed=0, nbytes=40)  # FP8 has run: 40 bytes of scaling history
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    saved.model(ids, labels=ids).loss.backward()
    saved.optimizer.step()
    saved.save(str(tmp_path / "step_3"))
    fresh = _trainer(seed=1, nbytes=0)  # a new process: nothing has run, empty extra state
    fresh.load(str(tmp_path / "step_3"))
    for (name, a), b in zip(saved.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name
    a_state = saved.optimizer.state_dict()["state"]
    b_state = fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(a_state[k]["exp_avg"], b_state[k]["exp_avg"]) for k in a_state)
    assert fresh.step == 3
    te_like = fresh.model.model.layers[0].te_like
    assert torch.equal(te_like.loaded, torch.arange(40, dtype=torch.uint8))  # the saved history, at its size
    # TE may unpickle it during this load (the checkpoint is trusted already: DCP's metadata is a pickle) ...
    assert te_like.pickle_opt_in == "1"
    # ... and only during it.
    assert os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] == "0"
    # Without the saved extra state there is nothing of ours to unpickle: no opt-in.
    os.remove(tmp_path / "step_3" / "extra_state.rank0.pt")
    again = _trainer(seed=1, nbytes=0)
    again.load(str(tmp_path / "step_3"))
    assert again.model.model.layers[0].te_like.pickle_opt_in == "0"
