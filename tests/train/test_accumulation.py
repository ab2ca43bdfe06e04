"""Gradient accumulation under FSDP2 (parallel.dp_shard=2 on 2 gloo ranks, 2 micro-batches per step) through the
real Trainer: the gradients are reduced once per step, after the last micro-batch, and the step's gradient equals
one process's with the whole batch in one forward, with fp32 and with bf16 gradients (train.precision=bf16: bf16
accumulation and reduction), and so do the step's reported gradient norm and loss. The ranks' rows carry very
different numbers of label tokens, so a loss normaliser that is not summed over ranks and micro-batches gives
another gradient."""

from __future__ import annotations

import pytest
import torch

from moe_tune.distributed.dims import BatchLayout
from tests.harness import run_ranks
from tests.tiny import VOCAB, rel_err

pytestmark = pytest.mark.dist
SEQ, MICRO, ACCUM, DP = 32, 2, 2, 2
# rel_err of the whole gradient against one process in the same precision: fp32 sums in another order; bf16
# gradients rounded per micro-batch and rank, and summed in bf16 (one process, the batch in 4 forwards instead of
# one: 3.2e-3; bf16 against fp32 differs by 0.12, which is why the reference is in the run's precision).
TOL = {"fp32": 1e-5, "bf16": 1e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _global_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's 8 rows (ids, labels). Rank 0's rows carry 2 to 5 label tokens, rank 1's all 31 positions; rows
    with a label at position 0 (never a target after the shift) and at the last position."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (MICRO * ACCUM * DP, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    for row in range(len(ids)):
        rank = (row // MICRO) % DP  # MicroBatches.row_indices: micro-batch m of rank r holds rows (m*DP + r)*MICRO..
        if rank == 0:
            keep = [0, 3 + row, 9 + row] if row % 2 else [5, SEQ - 1]
        else:
            keep = list(range(SEQ))
        labels[row, keep] = ids[row, keep]
    return ids, labels


def _reference_grads(path: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], float, float]:
    """One process, the whole batch in one forward: the gradient of the mean loss over its label tokens, its norm
    and the loss."""
    from moe_tune.build import from_pretrained

    model = from_pretrained(path, dtype=dtype, aux_loss_coef=0.0)
    model.train()
    ids, labels = _global_rows()
    loss = model(ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters()}
    return grads, float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))), float(loss)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "to_local") else t).detach().float().clone()


def _step_under_fsdp(rank: int, path: str, output_dir: str, precision: str) -> tuple[list[bool], dict, dict]:
    """One Trainer step on the FSDP-sharded model from this rank's micro-batches of ``_global_rows``: whether any
    sharded parameter held a reduced gradient at each micro-batch's forward, the full gradients the optimizer
    stepped with, and the step's reported gradient norm and loss."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.train import Trainer

    overrides = [
        f"output_dir={output_dir}/{precision}",
        "model=hf",
        f"model.path={path}",
        "data=random",
        "checkpoint.export_hf=false",
        f"train.precision={precision}",
        f"train.seq_len={SEQ}",
        f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={MICRO * ACCUM * DP}",
        "parallel.dp_shard=2",
        "train.aux_loss_coef=0",
    ]
    trainer = Trainer(to_config(compose(overrides)))
    assert trainer.layout == BatchLayout(MICRO, ACCUM, DP)
    model = trainer.model
    ids, labels = _global_rows()

    def rows(step, micro):
        start = (micro * DP + rank) * MICRO
        return ids[start : start + MICRO], labels[start : start + MICRO], None

    trainer._micro_batch = rows
    # The sharded parameters (DTensors): FSDP2 sets their gradients only when it reduces; between micro-batches the
    # module holds the unsharded parameters, whose gradients accumulate.
    sharded = [p for p in model.parameters() if hasattr(p, "to_local")]
    assert sharded
    reduced_before = []
    model.register_forward_pre_hook(lambda m, a: reduced_before.append(any(p.grad is not None for p in sharded)))
    seen, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        seen.update({n: _full(p.grad) for n, p in model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    out = trainer.train_step(0)
    return reduced_before, seen, {k: float(out[k]) for k in ("grad_norm", "loss")}


def _accumulation_body(rank: int, path: str, output_dir: str) -> None:
    for precision in ("fp32", "bf16"):
        ref, ref_norm, ref_loss = _reference_grads(path, DTYPES[precision])
        reduced_before, grads, reported = _step_under_fsdp(rank, path, output_dir, precision)
        assert reduced_before == [False] * ACCUM, reduced_before  # no reduction before the last backward
        assert set(grads) == set(ref)
        err = rel_err(torch.cat([grads[n].flatten() for n in ref]), torch.cat([g.flatten() for g in ref.values()]))
        assert err < TOL[precision], (precision, err)
        assert reported["grad_norm"] == pytest.approx(ref_norm, rel=TOL[precision])
        # The reported loss is the mean over every rank's label tokens, as one process's over the whole batch.
        assert reported["loss"] == pytest.approx(ref_loss, rel=TOL[precision]), (precision, reported, ref_loss)


def test_accumulation_under_fsdp_equals_one_process_with_the_whole_batch(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    run_ranks(_accumulation_body, 2, path, str(tmp_path))
