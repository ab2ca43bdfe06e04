"""Aux-loss-free balancing (DeepSeek-V3, train.bias_update_rate) on 2 gloo ranks through the real Trainer: after
one step every rank holds the same e_score_correction_bias, bit for bit, and it is the update computed from the
sum of both ranks' expert loads over the step's micro-batches (each rank routes different tokens, so its own loads
alone give another one; so would the last micro-batch's alone)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

pytestmark = pytest.mark.dist
RATE = 0.01
OVERRIDES = [
    "model=tiny_deepseek_v3",
    "data=random",  # uniform tokens: loads near the mean, where one rank's loads alone give another update
    "train.seq_len=64",
    "train.micro_batch_size=2",
    "data.num_samples=64",
    "train.precision=fp32",
    "train.aux_loss_coef=0",
    f"train.bias_update_rate={RATE}",
    "checkpoint.export_hf=false",
]


def _step_batches(trainer, step: int) -> list:
    """The (ids, labels, position_ids) micro-batches the trainer takes for ``step`` on this rank (the one place
    this test reaches into the trainer's data path)."""
    return [trainer._micro_batch(step, m) for m in range(trainer.layout.accum)]


def _local_loads(trainer, batches) -> torch.Tensor:
    """Rows per expert of every biased router on this rank's micro-batches, from the routers' own choices
    (a forward with the weights and biases the step starts from routes exactly as the step does)."""
    routers = [m.router for m in trainer.model.moe_layers() if m.router.e_score_correction_bias is not None]
    loads = [torch.zeros(r.spec.num_experts, dtype=torch.int64) for r in routers]

    def hook(i):
        def count(module, args, out):
            ids_TK = out[1]
            loads[i] += torch.bincount(ids_TK.reshape(-1), minlength=module.spec.num_experts)

        return count

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            for ids, _, pos in batches:
                trainer.model(ids, position_ids=pos, return_logits=True)  # both ranks: EP's all-to-all
    finally:
        for h in handles:
            h.remove()
    return torch.stack(loads)


def _expected_bias(before_LE: torch.Tensor, load_LE: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's rule, written out: each expert's bias moves by rate towards the mean load."""
    load = load_LE.float()
    return before_LE + torch.sign(load.mean(dim=-1, keepdim=True) - load) * RATE


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _bias_body(rank: int, output_dir: str, parallel: list[str]) -> None:
    from moe_tune.cli.train import compose, to_config
    from moe_tune.train import Trainer

    trainer = Trainer(to_config(compose([f"output_dir={output_dir}", *OVERRIDES, *parallel])))
    moes = [m for m in trainer.model.moe_layers() if m.router.e_score_correction_bias is not None]
    assert len(moes) == 2, len(moes)  # tiny_deepseek_v3: two MoE layers after a dense one
    before_LE = torch.stack([m.router.e_score_correction_bias.detach().clone() for m in moes])
    batches = _step_batches(trainer, 0)
    local_LE = _local_loads(trainer, batches)
    loads = _gather(local_LE)
    assert not torch.equal(loads[0], loads[1])  # the ranks routed different tokens
    expected_LE = _expected_bias(before_LE, sum(loads))
    # The test can tell: on some rank, that rank's own loads alone would give another bias.
    alone_differs = torch.tensor([int(not torch.equal(_expected_bias(before_LE, local_LE), expected_LE))])
    assert sum(_gather(alone_differs)).item() > 0
    if len(batches) > 1:  # the step's last micro-batch alone, on every rank, would give another bias
        assert not torch.equal(
            _expected_bias(before_LE, sum(_gather(_local_loads(trainer, batches[-1:])))), expected_LE
        )

    trainer.train_step(0)
    after_LE = torch.stack([m.router.e_score_correction_bias.detach().clone() for m in moes])
    biases = _gather(after_LE)
    assert torch.equal(biases[0], biases[1]), (biases[0] - biases[1]).abs().max()
    torch.testing.assert_close(after_LE, expected_LE, rtol=0, atol=0)
    assert not torch.equal(after_LE, before_LE)


@pytest.mark.parametrize(
    "parallel", [["parallel.ep=2"], ["train.global_batch_size=8"]], ids=["ep2", "fsdp_two_micro_batches"]
)
def test_bias_update_uses_both_ranks_loads_and_is_identical(tmp_path, parallel):
    run_ranks(_bias_body, 2, str(tmp_path), parallel)
