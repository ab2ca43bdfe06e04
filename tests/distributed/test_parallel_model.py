"""A tiny qwen3_moe under parallelize() on gloo ranks: training losses and gradient norms against EP=1 and the
single-process model, activation checkpointing, loading under EP, and bit-exact export from EP=2."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moe_tune.build import assemble, from_pretrained, model_options, source_loader
from moe_tune.config import Config
from moe_tune.distributed.clip import clip_grad_norm_
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.mesh import build_mesh
from moe_tune.models.hf_export import export_hf
from moe_tune.models.hf_io import CheckpointReader
from moe_tune.moe.experts import GroupedExperts
from moe_tune.optim import param_groups
from tests.harness import run_ranks
from tests.tiny import VOCAB, rel_err

pytestmark = pytest.mark.dist
STEPS, BATCH, SEQ, MAX_NORM = 3, 4, 16, 0.5
QWEN3_MOE = dict(router_aux_loss_coef=0.01)  # the tiny qwen3_moe, with a load-balancing coefficient


def _build(path: str, dims: ParallelDims, ac: str = "none", aux_coef: float = 0.0, precision: str = "fp32"):
    from transformers import AutoConfig

    cfg = Config()
    cfg.train.precision, cfg.parallel.activation_checkpointing = precision, ac
    cfg.train.aux_loss_coef = aux_coef
    mesh = build_mesh(dims, "cpu")
    hf_config = AutoConfig.from_pretrained(path)
    model = assemble(hf_config, model_options(cfg, dims), source_loader(path, 0), "cpu", path, (mesh, cfg))
    model.train()
    return model, mesh


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, mesh=None, max_norm: float = MAX_NORM) -> tuple[list[float], list[float]]:
    """AdamW steps; with a mesh, this rank takes its slice of each global batch. Returns (losses, norms)."""
    opt = torch.optim.AdamW(param_groups(model.parameters()), lr=1e-2, foreach=True)
    dp = 1 if mesh is None else mesh.dims.dp
    rank = 0 if mesh is None else dist.get_rank()
    losses, norms = [], []
    for ids in _batches():
        local = ids.chunk(dp)[rank]
        # Each rank divides its token sum by global tokens / dp: FSDP's gradient average makes it the global mean.
        out = model(local, labels=local, loss_normalizer=(ids.shape[0] * (SEQ - 1)) / dp)
        out.loss.backward()
        if mesh is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            norm = clip_grad_norm_(model, max_norm, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(loss)  # mesh axis dp (all ranks): mean of per-rank losses = the global mean
        losses.append(loss.item() / dp)
        norms.append(norm.item())
    return losses, norms


def _close(a: list[float], b: list[float], tol: float, what: str) -> None:
    err = rel_err(torch.tensor(a), torch.tensor(b))
    assert err < tol, f"{what}: {a} vs {b} (relative error {err:.2e})"


def _train_body(rank: int, path: str) -> None:
    ref = from_pretrained(path)
    ref.aux_loss_coef = 0.0  # the balancing loss is per rank: compared between EP=1 and EP=2 below
    ref_losses, ref_norms = _train(ref)
    ep1 = ParallelDims(dp_replicate=1, dp_shard=2, ep=1, world_size=2)
    ep2 = ParallelDims(dp_replicate=1, dp_shard=2, ep=2, world_size=2)
    losses, norms = _train(*_build(path, ep2))
    _close(losses, ref_losses, 1e-5, "EP=2+FSDP vs single process: losses")
    _close(norms, ref_norms, 1e-5, "EP=2+FSDP vs single process: grad norms")
    assert norms[0] > MAX_NORM  # clipping was exercised
    # With the (per-rank) load-balancing loss on, EP=2 against EP=1 on the same two ranks.
    a_losses, a_norms = _train(*_build(path, ep1, aux_coef=0.01))
    b_losses, b_norms = _train(*_build(path, ep2, aux_coef=0.01))
    _close(b_losses, a_losses, 1e-5, "EP=2 vs EP=1: losses")
    _close(b_norms, a_norms, 1e-5, "EP=2 vs EP=1: grad norms")
    for ac in ("full", "selective"):  # recomputation must not change the numbers
        c_losses, c_norms = _train(*_build(path, ep2, ac=ac, aux_coef=0.01))
        _close(c_losses, b_losses, 1e-6, f"activation_checkpointing={ac}: losses")
        _close(c_norms, b_norms, 1e-6, f"activation_checkpointing={ac}: grad norms")


def test_training_ep2_matches_ep1_and_single_process(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    run_ranks(_train_body, 2, path)


def _check_loaded(model, ref_state: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        # dense: gathered over dp_shard; experts: over efsdp only (this ep rank's rows), or plain tensors when
        # each ep rank alone holds its experts (efsdp = dp_replicate = 1: kept outside FSDP2)
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        want = ref_state[name]
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(experts, GroupedExperts):
            want = want[experts.first_expert : experts.first_expert + experts.num_local_experts]
        assert full.shape == want.shape and torch.equal(full, want), name


def _read_all(path: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {k: reader.rows(k) for k in sorted(reader.weight_map)}


def _load_export_body(rank: int, path: str, out: str, layouts: list[tuple[int, int, int]]) -> None:
    world = dist.get_world_size()
    ref_state = {k: v.detach().clone() for k, v in from_pretrained(path).state_dict().items()}
    dirs = []
    for dp_replicate, dp_shard, ep in layouts:
        model, mesh = _build(path, ParallelDims(dp_replicate, dp_shard, ep, world))
        _check_loaded(model, ref_state)
        with torch.no_grad():
            for p in model.parameters():  # a layout-independent change, so the export is not just the source
                (p.to_local() if hasattr(p, "to_local") else p).mul_(1.5)
        dirs.append(os.path.join(out, f"rep{dp_replicate}_shard{dp_shard}_ep{ep}"))
        export_hf(model, dirs[-1], mesh)
    if rank != 0:
        return
    source = {k: v * 1.5 for k, v in _read_all(path).items()}
    for d in dirs:
        got = _read_all(d)
        assert sorted(got) == sorted(source), d
        for k, v in source.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{d}: {k}"
        assert os.path.isfile(os.path.join(d, "config.json"))


def test_load_and_export_under_ep_2_ranks(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    run_ranks(_load_export_body, 2, path, str(tmp_path), [(1, 2, 1), (1, 2, 2)])


def test_a_family_with_experts_stacked_on_disk_loads_and_exports_under_ep_2_ranks(tmp_path, tiny_checkpoint):
    """GPT-OSS keeps each layer's experts as one stacked tensor on disk: under EP a rank reads its rows of it, and
    the row check holds the file's rows to the model's expert count, not to the rank's share of it."""
    path = tiny_checkpoint("gpt_oss")
    run_ranks(_load_export_body, 2, path, str(tmp_path), [(1, 2, 2)])


def _four_rank_body(rank: int, path: str, out: str) -> None:
    layouts = [(1, 4, 2), (2, 2, 2), (1, 4, 1)]
    _load_export_body(rank, path, out, layouts)
    ref = from_pretrained(path)
    ref.aux_loss_coef = 0.0
    ref_losses, ref_norms = _train(ref)
    for layout in layouts[:2]:
        losses, norms = _train(*_build(path, ParallelDims(*layout, world_size=4)))
        _close(losses, ref_losses, 1e-5, f"{layout} vs single process: losses")
        _close(norms, ref_norms, 1e-5, f"{layout} vs single process: grad norms")


def test_four_ranks_efsdp_and_hsdp(tmp_path, tiny_checkpoint):
    """efsdp = 2 (experts FSDP-sharded, gathered over efsdp) and HSDP (dp_replicate = 2): load, export, train."""
    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    run_ranks(_four_rank_body, 4, path, str(tmp_path))


def _precision_body(rank: int, path: str) -> None:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, ep=2, world_size=2)
    fp32_losses, _ = _train(*_build(path, dims))
    for precision, param_dtype in (("bf16_fp32_master", torch.float32), ("bf16", torch.bfloat16)):
        model, mesh = _build(path, dims, precision=precision)
        assert {p.dtype for p in model.parameters()} == {param_dtype}
        losses, _ = _train(model, mesh)
        _close(losses, fp32_losses, 2e-2, f"{precision} vs fp32")


def test_mixed_precision_ep2(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    run_ranks(_precision_body, 2, path)


def test_world_size_one_same_code_path(tiny_checkpoint, no_launcher):
    """No launcher: init_distributed makes a 1-rank group and parallelize runs the same FSDP path. The model is
    on the CPU here, so the group is gloo's even where a GPU is visible (whose default would be nccl)."""
    from moe_tune.distributed.process_group import destroy_distributed, init_distributed

    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    env = init_distributed(backend="gloo")
    try:
        assert (env.world_size, env.launcher, dist.get_world_size(), dist.get_backend()) == (1, "single", 1, "gloo")
        for max_norm in (MAX_NORM, 1e3):  # clipped, and a norm below the maximum that must stay as it is
            ref = from_pretrained(path)
            ref.aux_loss_coef = 0.0
            ref_losses, ref_norms = _train(ref, max_norm=max_norm)
            losses, norms = _train(*_build(path, ParallelDims(1, 1, 1, 1)), max_norm=max_norm)
            _close(losses, ref_losses, 1e-5, f"world size 1 vs plain model, max_norm {max_norm}: losses")
            _close(norms, ref_norms, 1e-5, f"world size 1 vs plain model, max_norm {max_norm}: grad norms")
        assert MAX_NORM < min(norms) and max(norms) < 1e3
    finally:
        destroy_distributed()


def _unused_keys_body(rank: int, path: str) -> None:
    import gc

    from moe_tune.config import CheckpointError

    message = ""
    try:
        _build(path, ParallelDims(dp_replicate=1, dp_shard=2, ep=2, world_size=2))
    except CheckpointError as e:
        message = str(e)
    # Drop the half-built sharded model and line the ranks up before the harness destroys the group
    # (a gloo group torn down under live DTensors can abort the process).
    gc.collect()
    dist.barrier()
    # Every rank names the one leftover key, though no rank alone reads the whole checkpoint.
    assert "has 1 tensors the model does not use (e.g. model.layers.0.mlp.extra.weight)" in message, message


def test_sharded_load_rejects_leftover_checkpoint_tensors(tiny_checkpoint):
    """Under EP+FSDP each rank reads a different subset of keys; a key no rank reads is still an error."""
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint("qwen3_moe", **QWEN3_MOE)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    run_ranks(_unused_keys_body, 2, path)
