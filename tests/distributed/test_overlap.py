"""comm.overlap=true on the tiny Qwen3-MoE under EP=2 + FSDP (2 gloo ranks, fp32): the same losses and the same
gradients (this rank's shards of every parameter) as comm.overlap=false on two batches, within 1e-6 (each
parameter alone within 1e-5, see ``_compare``; in fp64 the two paths agree to 1e-12: tests/moe/dispatch); also
under full activation checkpointing, whose recompute runs the overlapped dispatch again; and comm.dedup=false
(one row per routed expert) against dedup=true (one row per token and ep rank), with and without overlap. Each
rank holds an odd and different number of tokens, so the halves differ in size and the ranks' splits are uneven.
(The layer on empty splits and single tokens: tests/moe/dispatch/test_overlap.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_tune.build import assemble, model_options, source_loader
from moe_tune.config import AllToAllConfig, Config
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.mesh import build_mesh
from moe_tune.moe.layer import MoE
from tests.harness import run_ranks
from tests.tiny import VOCAB, rel_err

pytestmark = pytest.mark.dist
BATCHES, LENGTHS = 2, (15, 9)  # tokens on rank 0 and rank 1: halves 8/7 and 5/4


def _build(path: str, overlap: bool, ac: str = "none", dedup: bool = True):
    from transformers import AutoConfig

    cfg = Config()
    cfg.train.precision, cfg.parallel.activation_checkpointing = "fp32", ac
    cfg.train.aux_loss_coef = 0.01
    cfg.comm = AllToAllConfig(overlap=overlap, dedup=dedup)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, ep=2, world_size=2)
    mesh = build_mesh(dims, "cpu")
    model = assemble(
        AutoConfig.from_pretrained(path), model_options(cfg, dims), source_loader(path, 0), "cpu", path, (mesh, cfg)
    )
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(m.dispatcher.overlap is overlap for m in layers)
    return model.train()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _grads(model, rank: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """(loss, this rank's gradient shards) of each batch, on this rank's tokens, the weights unchanged (an
    optimizer step would amplify the last-bit differences of the expert gradients summed in two halves)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(BATCHES):
        ids = torch.randint(0, VOCAB, (2, max(LENGTHS)), generator=g)[rank : rank + 1, : LENGTHS[rank]]
        out = model(ids, labels=ids, loss_normalizer=float(sum(LENGTHS) - 2))
        out.loss.backward()
        batches.append((out.loss.item(), {n: _local(p.grad) for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    return batches


def _compare(got, want, what: str) -> list[str]:
    """Losses and the whole gradient (every parameter's shard on this rank, as one vector) within 1e-6; each
    parameter's gradient within 1e-5: some are sums that cancel (the q/k norms' weights), where fp32's last-bit
    differences of the expert GEMMs (row blocks of another size in each half) reach ~1e-6 of their small norm."""
    failures = []
    for batch, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want)):
        if abs(loss - ref_loss) > 1e-6 * abs(ref_loss):
            failures.append(f"{what} batch {batch}: loss {loss} vs {ref_loss}")
        whole = rel_err(
            torch.cat([grads[n].flatten() for n in ref_grads]), torch.cat([g.flatten() for g in ref_grads.values()])
        )
        if whole > 1e-6:
            failures.append(f"{what} batch {batch}: whole gradient rel err {whole:.1e}")
        errs = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
        failures += [f"{what} batch {batch} {n}: rel err {e:.1e}" for n, e in errs.items() if e > 1e-5]
        print(what, batch, "whole", whole, "worst", max(errs.values()), "loss", abs(loss - ref_loss) / abs(ref_loss))
    return failures


def _body(rank: int, path: str) -> None:
    plain = _grads(_build(path, overlap=False), rank)
    failures = _compare(_grads(_build(path, overlap=True), rank), plain, "overlap")
    failures += _compare(_grads(_build(path, overlap=True, ac="full"), rank), plain, "overlap + full AC")
    # comm.dedup=false (one row per routed expert, summed at home) against dedup=true (one row per ep rank).
    failures += _compare(_grads(_build(path, overlap=False, dedup=False), rank), plain, "dedup=false")
    failures += _compare(_grads(_build(path, overlap=True, dedup=False), rank), plain, "overlap, dedup=false")
    dist.barrier()
    assert not failures, f"rank {rank}: " + "; ".join(failures)


def test_overlap_same_losses_and_gradients_ep2(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", router_aux_loss_coef=0.01)
    run_ranks(_body, 2, path)
