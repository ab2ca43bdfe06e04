"""Write a (possibly sharded, expert-parallel) model as a Hugging Face checkpoint, streaming.

Every rank walks the tensors in the same order. A sharded tensor is gathered (over its FSDP mesh) one at a time; its
owner in the output keeps it, the others drop it at once: no rank holds more than one full tensor beyond its own
output shard. Experts are written by the ep rank that holds them (they never travel across the expert-parallel
group). Each writing rank flushes its own ``.safetensors`` files; rank 0 writes the index and the config.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moe_tune.config import ConfigError
from moe_tune.distributed.process_group import rank_world
from moe_tune.models.fp32_islands import export_dtypes
from moe_tune.models.generation import stop_at_end_of_turn, write_chat_template
from moe_tune.models.hf_io import (
    DRAWN_WITH,
    EXPERT_PARAM,
    SIDE_FILES,
    copy_side_files,
    expert_offsets,
    named_tensors,
    quantized_source_tensors,
    remote_code_files,
    source_dtypes,
    stacked_on_disk,
    to_disk_tensors,
    unloaded_source_keys,
)
from moe_tune.models.shard_index import INDEX
from moe_tune.models.tied_head import with_tied_head


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards are DTensors: full_tensor() all-gathers over the tensor's own mesh (dp_shard or efsdp).
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gather_experts(local: torch.Tensor, ep_group) -> torch.Tensor:
    if ep_group is None:
        raise ValueError("exporting EP-sharded experts stored stacked needs ep_group (the ep mesh axis's group)")
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    # Collective over the ep mesh axis: every ep rank's expert slice, in expert order (ep rank s owns block s).
    dist.all_gather(pieces, local.contiguous(), group=ep_group)
    return torch.cat(pieces)


@torch.no_grad()
def write_checkpoint(
    model,
    out_dir: str,
    max_shard_bytes: int = 4 << 30,
    expert_writer: bool | None = None,
    dtype=None,
    ep_group=None,
    chat_template: str | None = None,
) -> None:
    """``chat_template``: written as chat_template.jinja over the source's (the template training rendered with).
    ``expert_writer``: whether this rank writes its local experts (one rank per ep group; the caller
    decides, e.g. the efsdp/dp_replicate rank 0). Dense tensors are written round-robin over all ranks.
    ``ep_group``: under EP, experts that the checkpoint stores as one stacked key are gathered over it."""
    rank, world = rank_world()
    expert_writer = rank == 0 if expert_writer is None else expert_writer
    os.makedirs(out_dir, exist_ok=True)
    family = model.family
    dtypes = source_dtypes(model.source_dir) if model.source_dir else {}
    key_dtype = export_dtypes(model, dtype)
    offsets = expert_offsets(model)
    ep_sharded = bool(offsets)
    tied = getattr(model.config, "tie_word_embeddings", False)

    writer = _ShardWriter(out_dir, rank, max_shard_bytes)
    dense_index = 0
    for name, t in named_tensors(model):
        if tied and name == "lm_head.weight":
            continue
        full = full_tensor(t)
        is_expert = EXPERT_PARAM.match(name) is not None
        first = offsets.get(name, 0)
        if is_expert and ep_sharded and stacked_on_disk(family, name, dtypes):
            full, first, is_expert = gather_experts(full, ep_group), 0, False  # then written like a dense tensor
        if is_expert and ep_sharded:
            mine = expert_writer
        else:
            mine = dense_index % world == rank
            dense_index += 1
        if not mine:
            continue
        for key, piece in with_tied_head(to_disk_tensors(family, name, full, first, dtypes), tied, dtypes):
            writer.add(key, piece.to(key_dtype(key, dtypes.get(key, piece.dtype))).detach().cpu().contiguous())
    _add_source_tensors(model, writer, key_dtype, dtypes, expert_writer if ep_sharded else rank == 0)
    writer.flush()
    error, gathered = writer.error, [(writer.files, writer.nbytes)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (writer.files, writer.nbytes))
    if rank == 0 and error is None:
        try:
            _write_index(out_dir, gathered, world)
            _write_config(model, out_dir, dtype)
            copy_side_files(model.source_dir, out_dir)
            write_chat_template(out_dir, chat_template)
            stop_at_end_of_turn(out_dir)
        except Exception as e:  # raised on every rank by end_together
            error = e
    end_together(error)


def _add_source_tensors(model, writer, key_dtype, dtypes: dict, expert_writer: bool) -> None:
    """What the export takes from the source's files as they are: the experts of a quantized base (held only
    quantized) and the layers loading skips (round-robin over the ranks)."""
    rank, world = rank_world()
    for key, t in quantized_source_tensors(model, expert_writer, rank == 0):
        writer.add(key, t.to(key_dtype(key, dtypes.get(key, t.dtype))).contiguous())
    reader, unloaded = unloaded_source_keys(model)
    for key in unloaded[rank::world]:
        writer.add(key, reader.rows(key).to(key_dtype(key, reader.dtype(key))).contiguous())


def end_together(error: Exception | None) -> None:
    """The end of an export's writes on every rank, in place of a barrier: all ranks learn whether each wrote its
    share, and all raise when one failed (a full disk on one rank), instead of the others waiting in a collective
    for a rank that has gone. The failed rank raises ``error``; the others an OSError naming that rank and its
    error (a full disk keeps ENOSPC, so each rank reads it as one). One process: raises ``error`` if any."""
    failures, world = [error], rank_world()[1]
    if world > 1:
        mine = None if error is None else (getattr(error, "errno", None), f"{type(error).__name__}: {error}")
        failures = [None] * world
        dist.all_gather_object(failures, mine)
    if error is not None:
        raise error
    for other, failure in enumerate(failures):
        if failure is not None:
            code, text = failure
            raise OSError(code or errno.EIO, f"rank {other} could not write its share of the export ({text})")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """``safetensors.torch.save_file``, readable as any other file the run writes (``as_umask_allows``)."""
    save_file(tensors, path, metadata={"format": "pt"})
    as_umask_allows(path)


def as_umask_allows(path: str) -> None:
    """The mode an ordinary file gets under the process umask: safetensors creates its files 0600, which would
    keep the weights from the rest of a shared cluster's group."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# Written into every export (moe-tune-export's and a run's hf/): what moe-tune-export may replace without --overwrite.
EXPORT_MARKER = "moe_tune_export.json"
# What an export writes besides SIDE_FILES (copied from the source) and its weights; a tiny base_model/'s seed record.
_EXPORT_FILES = ("config.json", "model.safetensors.index.json", "adapter_config.json", EXPORT_MARKER, DRAWN_WITH)


def _written_by_an_export(name: str) -> bool:
    weights = name.startswith(("model", "adapter_model")) and name.endswith(".safetensors")
    return weights or name in _EXPORT_FILES or name in SIDE_FILES


def check_export_target(out_dir: str) -> None:
    """An export replaces ``out_dir`` as a whole, so it must be new, empty or an earlier export: anything else
    in it (a run directory, the working directory, someone's notes) would be deleted. Raises ConfigError."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} is a file, not a directory; give a new directory for the export")
    if os.path.realpath(out_dir) == os.path.realpath(os.getcwd()):
        raise ConfigError(
            f"{out_dir} is the current directory, which an export replaces as a whole (the shell would be left in "
            "a removed directory); give a new directory"
        )
    code = set(remote_code_files(out_dir))  # copied from the source with its config.json
    foreign = sorted(
        name
        for name in os.listdir(out_dir)
        if not ((_written_by_an_export(name) or name in code) and os.path.isfile(os.path.join(out_dir, name)))
    )
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ConfigError(
            f"{out_dir} holds {shown}, which no export writes, and an export replaces its directory as a whole; "
            "give a new or empty directory (or an earlier export's)"
        )


def check_replaceable(out_dir: str, sources: dict[str, str], overwrite: bool = False) -> None:
    """moe-tune-export's guard over ``check_export_target``: unless ``overwrite``, an existing non-empty ``out_dir``
    must be an earlier export (it holds EXPORT_MARKER) and no checkpoint's model: ``sources`` maps each model
    directory a checkpoint reads (its run's source, a LoRA run's base) to that checkpoint. Replacing a model
    directory moe_tune did not write (a download, a run's base_model/) would destroy the only copy of those
    weights, and replacing a checkpoint's base would leave its adapters unusable. Raises ConfigError."""
    check_export_target(out_dir)
    if overwrite or not os.path.isdir(out_dir):
        return
    real = os.path.realpath(out_dir)
    for source, checkpoint in sources.items():
        if os.path.realpath(source) == real:
            raise ConfigError(
                f"{out_dir} is the model checkpoint {checkpoint} was trained from, which it needs to resume and "
                "export; give a new directory for the export (or --overwrite to replace it anyway)"
            )
    if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, EXPORT_MARKER)):
        raise ConfigError(
            f"{out_dir} holds a model that moe-tune-export did not write (no {EXPORT_MARKER}), and an export "
            "replaces its directory as a whole; give a new directory (or --overwrite to replace it)"
        )


def write_checkpoint_atomic(model, out_dir: str, writer=None, **options) -> None:
    """``writer(model, dir, **options)`` (default ``write_checkpoint``; ``peft_export.write_adapter`` for a LoRA
    adapter) into a temporary sibling of ``out_dir`` (same filesystem), then swapped in by rank 0
    after every rank has written: the old directory is renamed away, the new one renamed in, the old deleted. A
    reader never sees two exports mixed (stale shards of another layout or sharding cannot remain), and an export
    that fails leaves the previous one in place, and no temporary directory. Every rank must call it. ``out_dir``
    must be new, empty or an earlier export (``check_export_target``)."""
    check_export_target(out_dir)
    out_dir = os.path.realpath(out_dir)  # through a symlink: its target is replaced, the link kept
    rank, world = rank_world()
    parent, name = os.path.split(os.path.abspath(out_dir))
    tmp, old = os.path.join(parent, f".{name}.partial"), os.path.join(parent, f".{name}.old")
    if rank == 0:
        os.makedirs(parent, exist_ok=True)
        for leftover in (tmp, old):  # from an export that was interrupted
            shutil.rmtree(leftover, ignore_errors=True)
    if world > 1:
        dist.barrier()  # every rank writes into the fresh temporary directory
    try:
        (writer or write_checkpoint)(model, tmp, **options)  # ends with a barrier over all ranks when world > 1
        if rank == 0:
            with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
                json.dump({"written_by": "moe_tune"}, f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export (a full disk) leaves no partial directory
        raise
    if rank == 0:
        target = os.path.join(parent, name)
        if os.path.lexists(target):
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()  # the new directory is in place for every rank


def _write_index(out_dir: str, gathered: list[tuple[dict[str, str], int]], world: int) -> None:
    """Rank 0: the safetensors index over every rank's files (renamed as Hugging Face names them when a
    single process wrote them all)."""
    weight_map = {k: v for f, _ in gathered for k, v in f.items()}
    total = sum(n for _, n in gathered)
    fnames = sorted(set(weight_map.values()))
    if world == 1:  # one writer: Hugging Face's own file names
        names = (
            ["model.safetensors"]
            if len(fnames) == 1
            else [f"model-{i + 1:05d}-of-{len(fnames):05d}.safetensors" for i in range(len(fnames))]
        )
        for old, new in zip(fnames, names):
            os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
        weight_map = {k: names[fnames.index(v)] for k, v in weight_map.items()}
    written = set(weight_map.values())
    if fnames and not (world == 1 and len(fnames) == 1):
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        written.add(INDEX)
    remove_stale_weights(out_dir, written)


# The weight files and index a save writes. An earlier save's left in the same directory would be read in place
# of this one's: its index by moe_tune (which reads an index first), its model.safetensors by transformers.
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5}|-rank\d{5}-part\d{3})?\.safetensors|" + re.escape(INDEX))


def remove_stale_weights(out_dir: str, written: set[str]) -> None:
    for name in os.listdir(out_dir):
        if WEIGHT_FILE.fullmatch(name) and name not in written:
            os.remove(os.path.join(out_dir, name))


class _ShardWriter:
    """Streams this rank's output: a ``.safetensors`` file is written as soon as it reaches the size limit,
    so a rank holds at most one shard of output in host memory."""

    def __init__(self, out_dir: str, rank: int, max_bytes: int):
        self.out_dir, self.rank, self.max_bytes = out_dir, rank, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.nbytes = 0
        self.files: dict[str, str] = {}
        # The first failed write (a full disk): later shards are dropped, and the ranks' collectives go on to
        # end_together, which raises it on every rank.
        self.error: Exception | None = None

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self.flush()
        self.pending[key] = t
        self.size += n
        self.nbytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        part = len(set(self.files.values()))
        fname = f"model-rank{self.rank:05d}-part{part:03d}.safetensors"
        if self.error is None:
            try:
                save_safetensors(self.pending, os.path.join(self.out_dir, fname))
            except Exception as e:
                self.error = e
        self.files.update(dict.fromkeys(self.pending, fname))
        self.pending, self.size = {}, 0


def _write_config(model, out_dir: str, dtype: torch.dtype | None = None) -> None:
    """The source's config.json as it is, but for what the export changed: no quantization_config (a block-scaled
    FP8 source is written as bf16), and ``dtype`` (the weights' dtype, when given, transformers' fp32 islands
    aside) as the dtype transformers then loads them in."""
    src = os.path.join(model.source_dir, "config.json") if model.source_dir else None
    if src and os.path.isfile(src):
        with open(src) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        if dtype is not None:
            cfg["dtype"] = str(dtype).removeprefix("torch.")
            if "torch_dtype" in cfg:  # transformers v4's name for it
                cfg["torch_dtype"] = cfg["dtype"]
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    else:
        model.config.save_pretrained(out_dir)
