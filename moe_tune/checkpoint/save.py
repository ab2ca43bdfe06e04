"""Saving a checkpoint: stage the state (``moe_tune.checkpoint.background``), write it with DCP, then the
manifest and ``COMPLETE`` (``moe_tune.checkpoint.manifest``), inline or on the writer thread."""

from __future__ import annotations

import copy
import functools
import logging
import os
import shutil
import time

import torch
import torch.distributed as dist

from moe_tune.checkpoint import background, manifest, safe
from moe_tune.checkpoint.background import CheckpointSaver
from moe_tune.checkpoint.run_state import RunState
from moe_tune.checkpoint.state import extra_state_file, flat_state, frozen_names, is_extra_state
from moe_tune.run_record import write_json

log = logging.getLogger("moe_tune")


def save(state: RunState, step: int, path: str, saver: CheckpointSaver | None = None) -> float:
    """Save ``state`` at optimizer step ``step`` as ``path``; returns the seconds training was blocked. With a background
    ``saver`` (``checkpoint.async_save``) that is the wait for the previous save plus the device-to-host copy; the
    write, the manifest and ``COMPLETE`` follow on the writer thread. Without one: synchronous, complete on
    return."""
    start = time.perf_counter()
    saver = saver or CheckpointSaver(async_save=False)
    waited = saver.wait()  # one save in flight at most: the previous one is complete first
    # The newest complete checkpoint but this one (saved over after a signal at a step just saved, it is not
    # complete while rewritten): what a disk-full message can point to.
    root = os.path.dirname(os.path.dirname(path))
    previous = next((p for p in manifest.complete_checkpoints(root) if p != path), None)
    with safe.disk_full_exits(path, previous, state.rank):
        if state.rank == 0:
            _clear_for_save(path)
        if dist.is_initialized():
            dist.barrier()  # no rank writes into the directory while it still claims to be complete
        staged_at = time.perf_counter()
        tensors, meta, num_bytes = _stage(state, step, path, saver)
        staging = time.perf_counter() - staged_at
    keep = state.cfg.checkpoint.keep_last
    job = functools.partial(_write, tensors, meta, path, step, state.rank, saver.group(), keep)

    def on_error(e: BaseException) -> None:
        with safe.disk_full_exits(path, previous, state.rank):
            raise e

    saver.run(job, on_error)
    stall = time.perf_counter() - start
    if state.rank == 0:
        how = "async, written in the background" if saver.async_save else "sync (checkpoint.async_save=false)"
        log.info(
            "checkpoint_stall step=%d stall_s=%.3f staging_s=%.3f wait_previous_s=%.3f staged_gib=%.3f: "
            "training was blocked %.2f s by the save of %s (%s)",
            step,
            stall,
            staging,
            waited,
            num_bytes / 2**30,
            stall,
            path,
            how,
        )
    return stall


def _clear_for_save(path: str) -> None:
    """Rank 0, before a save into ``path``: whatever is there goes whole, ``COMPLETE`` first, so a reader never
    takes it for complete while it is rewritten. A complete checkpoint there is saved over on purpose (a run resumed
    from an earlier checkpoint); a directory without ``COMPLETE`` was left by a save cut short or damaged. Either
    way no file of it stays beside the new save's, and DCP finds no ``.metadata`` to warn about overwriting."""
    if os.path.isfile(os.path.join(path, manifest.COMPLETE)):
        os.remove(os.path.join(path, manifest.COMPLETE))
    if os.path.isdir(path):
        shutil.rmtree(path)


def prepare_save(state: RunState, saver: CheckpointSaver) -> None:
    """Allocate a background save's host copy ahead of the first save, off the training thread (once the
    optimizer's state exists: after the first step)."""
    if saver.wants_buffers():
        saver.prepare(flat_state(state.model, state.optimizer)[0])


def _stage(state: RunState, step: int, path: str, saver: CheckpointSaver) -> tuple[dict, dict | None, int]:
    """On the training thread: the tensors to write (host copies for a background save, this rank's bytes),
    meta.json's content (rank 0, host values of this step), the modules' extra state written."""
    flat, model_sd, optim_sd = flat_state(state.model, state.optimizer)
    extra = {k: v for k, v in model_sd.items() if is_extra_state(k)}
    if extra:  # small: written now, before the writer's collectives and COMPLETE
        os.makedirs(path, exist_ok=True)
        torch.save(extra, extra_state_file(path, state.rank))
        manifest.fsync(extra_state_file(path, state.rank))
    tensors, num_bytes = saver.stage(flat)
    meta = None
    if state.rank == 0:
        from dataclasses import asdict

        meta = {
            "step": step,
            "scheduler": state.scheduler.state_dict(),
            "param_groups": optim_sd["param_groups"],
            "source": state.source,
            "config": asdict(state.cfg),
            "rows_per_step": state.layout.rows_per_step,  # the global batch, which a resume keeps (the data order)
            "chat_template": state.chat_template,  # data.chat_template's text: moe-tune-export writes it
            "data_rows": state.data_rows,  # what the training rows were made of: a resume compares it
        }
        if saver.async_save:  # the live scheduler and groups change at the next step
            meta = copy.deepcopy(meta)
        if state.source is not None and frozen_names(state.model):  # LoRA: what the adapters belong to
            from moe_tune.models.source_check import base_fingerprint

            meta["base_fingerprint"] = base_fingerprint(state.source)
    return tensors, meta, num_bytes


def _write(tensors: dict, meta: dict | None, path: str, step: int, rank: int, group, keep: int) -> None:
    """The save's files, then COMPLETE (collective on ``group``: the writer's, or the default group inline)."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    with background.writer_thread_errors() as errors:
        dcp.save(tensors, storage_writer=background.storage_writer(path), process_group=group)  # every file fsync'd
    failed = [bool(errors)]
    if dist.is_initialized():  # every rank's files are written, or some rank's are not: all raise, none goes on
        failed = [None] * dist.get_world_size(group)
        dist.all_gather_object(failed, bool(errors), group=group)
    if any(failed):
        raise errors[0] if errors else OSError(f"another rank's files of {path} could not be written")
    if rank == 0:
        write_json(os.path.join(path, "meta.json"), meta)  # flushed and fsync'd
    written = time.perf_counter()
    if dist.is_initialized():
        dist.barrier(group=group)  # meta.json is written: list and hash every file
    files = manifest.write_complete(path, step, group=group)  # COMPLETE with sizes and checksums, last (rank 0)
    if dist.is_initialized():
        dist.barrier(group=group)
    done = time.perf_counter()
    root = os.path.dirname(os.path.dirname(path))
    if rank == 0 and keep:  # after the last barrier: every rank is done with the older ones
        for old in manifest.prune(root, keep, step):
            log.info("deleted %s (checkpoint.keep_last=%d)", old, keep)
    if rank == 0:
        total = sum(entry["size"] for entry in files.values())
        log.info(
            "checkpoint_written step=%d write_s=%.3f manifest_s=%.3f total_s=%.3f gib=%.3f write_gib_per_s=%.3f: %s "
            "is complete",
            step,
            written - start,
            done - written,
            done - start,
            total / 2**30,
            total / 2**30 / max(written - start, 1e-9),
            path,
        )
