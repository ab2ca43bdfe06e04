"""Checkpoint writes off the training thread (``checkpoint.async_save``).

A save stops training only for the device-to-host copy of its tensors (``stage``: into one CPU copy of the
saved state, allocated on a thread ahead of the first save and reused); a writer thread then runs DCP's save of that copy, hashes
the files it wrote into the manifest and writes ``COMPLETE`` last (``moe_tune.checkpoint.manifest``), while the
loop trains on. At most one save is in flight: the next save, the end of ``fit`` and a signal stop wait for it
(``wait``), and an error of the write is raised there, on the training thread. The thread is not a daemon, so a
process that leaves any other way still finishes the write before it exits; a kill mid-write leaves a directory
without ``COMPLETE``, which a resume passes over.

The writer's collectives (DCP's plan and metadata gathers, the manifest's) run on a gloo group of their own, so
they never interleave with the training thread's collectives on the default group.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_tune.distributed.shard import local, local_bytes

log = logging.getLogger("moe_tune")


# Files each rank writes at once (one thread each): one stream wrote about half of what the disk takes.
WRITE_THREADS = 8


def storage_writer(path: str):
    """DCP's file writer, fsyncing every file it writes (a test slows it down to kill a process mid-write)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, sync_files=True, thread_count=WRITE_THREADS)


@contextlib.contextmanager
def writer_thread_errors():
    """The exceptions of DCP's writer threads during a save, kept instead of printed. DCP prints a failed writer
    thread's traceback (a full disk: about two hundred lines from eight threads before the save's one line) and
    returns as if its files were written when the failure was not in the calling thread's own share: the caller
    must raise what this collects (``save._write``). Other threads' exceptions print as before."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def keep(args) -> None:
        if args.thread is not None and "_write_files_from_queue" in args.thread.name:
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = keep
    try:
        yield errors
    finally:
        threading.excepthook = previous


def _layout(state: dict) -> list:
    return [(k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, type(v)) for k, v in state.items()]


class CheckpointSaver:
    """The run's saves, one at a time: ``run(job)`` runs ``job`` on a writer thread when ``async_save`` (after
    the previous one finished), else inline. ``prepare(state)`` allocates the host copy ahead, ``stage(state)``
    copies ``state``'s tensors into it."""

    def __init__(self, async_save: bool, device=None):
        self.async_save = async_save
        self.device = device  # the default group's device: the first background save's agreement runs there
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._on_error: Callable | None = None  # re-raises the write's error in its save's context
        self._staged: dict | None = None
        self._staged_layout: list | None = None
        self._preparing: threading.Thread | None = None  # prepare()'s allocation, joined by stage()
        self._decided: bool | None = None  # whether the host copy fits (all ranks agreed), once known
        self._group = None

    def group(self):
        """The writer's process group (all ranks, gloo), made at the first background save: a collective that
        every rank reaches at the same step. None for a synchronous save (the default group) or without one."""
        if not self.async_save or not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # all ranks
        return self._group

    def wants_buffers(self) -> bool:
        """A background saver whose host copy is neither allocated nor being allocated."""
        return self.async_save and self._staged is None and self._preparing is None

    def prepare(self, state: dict) -> None:
        """Collective at the first call (every rank at the same step): decide whether the host copy fits
        (``_host_copy_fits``), then allocate it on a thread while training goes on (faulting in tens of GiB
        takes seconds: not inside a save's stall). ``stage`` uses it when the layout still matches."""
        if not self.wants_buffers():
            return
        shapes = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if not self._fits(shapes):
            return

        def allocate() -> None:
            self._staged, self._staged_layout = _host_buffers(shapes), _layout(state)

        self._preparing = threading.Thread(target=allocate, name="moe_tune-checkpoint-staging")
        self._preparing.start()

    def _fits(self, tensors: dict) -> bool:
        """Whether a background save goes on: decided once (collective), False for the rest of the run."""
        if self._decided is None:
            self._decided = _host_copy_fits(_bytes(tensors), self.device)
            self.async_save = self._decided
        return self._decided

    def stage(self, state: dict) -> tuple[dict, int]:
        """A host copy of ``state`` (into the same buffers every save) and this rank's bytes; a synchronous save
        writes the live tensors. Whether the copies fit is agreed at ``prepare`` or, without it, here."""
        size = _bytes(state)
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if not (self.async_save and self._fits(state)):
            return state, size
        on_gpu = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in state.values())
        layout = _layout(state)
        if self._staged is None or layout != self._staged_layout:
            self._staged = _host_buffers({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
            self._staged_layout = layout
        staged = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local(self._staged[key]).copy_(local(value), non_blocking=on_gpu)
                staged[key] = self._staged[key]
            else:  # Python values (a step count): their own copy
                staged[key] = copy.deepcopy(value)
        if on_gpu:
            torch.cuda.synchronize()  # host sync: the copy must be whole before training changes the tensors
        return staged, size

    def run(self, job: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        """``job`` now (synchronous) or on the writer thread; ``on_error(e)`` re-raises its error where the
        caller waits (``wait``)."""
        self.wait()
        if not self.async_save:
            try:
                job()
            except BaseException as e:
                on_error(e)
            return
        self._on_error = on_error

        def body() -> None:
            try:
                job()
            except BaseException as e:  # raised on the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=body, name="moe_tune-checkpoint-writer")
        self._thread.start()

    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def raise_failure(self) -> None:
        """A save in flight that has already ended with an error raises it here (``wait``); otherwise nothing."""
        if self._thread is not None and not self._thread.is_alive() and self._error is not None:
            self.wait()

    def wait(self) -> float:
        """Block until the save in flight (if any) is on disk with its ``COMPLETE``; its error raised here.
        Returns the seconds waited."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - start
        error, on_error = self._error, self._on_error
        self._error = self._on_error = None
        if error is not None and on_error is not None:
            on_error(error)
        return waited


def _bytes(state: dict) -> int:
    """This rank's bytes of ``state``'s tensors (a DTensor's local shard)."""
    return sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))


def _host_buffers(tensors: dict) -> dict:
    """A host tensor for each of ``tensors`` (a DTensor's local shard, wrapped as a DTensor of the same mesh and
    placements), its pages touched. Pageable, not pinned: page-locking tens of GiB on a thread slowed the training
    steps it overlapped many times over on an H200; a copy into pageable memory is slower per save instead
    (benchmarks/README.md, "Checkpoints in the background")."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in tensors.items():
        mine = local(value)
        host = torch.zeros(mine.shape, dtype=mine.dtype)  # written now: no page faults inside a save's stall
        if isinstance(value, DTensor):
            host = DTensor.from_local(
                host, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        out[key] = host
    return out


def _mem_available() -> int | None:
    """The node's available memory in bytes (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _host_copy_fits(num_bytes: int, device) -> bool:
    """Whether every node's ranks can each hold a host copy of their ``num_bytes`` in 80% of the node's
    available memory (agreed by all ranks: MIN all-reduce on the default group)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _mem_available()
    fits = available is None or num_bytes * ranks_here <= 0.8 * available
    if not fits:
        log.warning(
            "checkpoint.async_save: %d ranks on this node would each keep a %.1f GiB host copy of their state, more "
            "than 80%% of the %.1f GiB available: every save of this run is synchronous (set "
            "checkpoint.async_save=false to say so, or free host memory)",
            ranks_here,
            num_bytes / 2**30,
            available / 2**30,
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(fits)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # mesh: all ranks (the default group)
        fits = bool(flag.item())  # host sync: once, at the first save
    return fits


__all__ = ["CheckpointSaver", "storage_writer"]
