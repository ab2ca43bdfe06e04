"""The run lock: one run at a time writes to an ``output_dir``.

Rank 0 holds an advisory ``fcntl.flock`` on ``output_dir/.lock`` for the life of the process, and writes who it
is into the file (``pid@host since <UTC time>``) so that a second run can name the holder. The kernel drops
the lock when its process dies (SIGKILL included), so a lock file left by a dead run is not held: the next run
takes it over with a warning. All ranks learn rank 0's verdict through one broadcast and then raise the same
error, so every rank exits 2 together.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket

import torch.distributed as dist

from moe_tune.config import ConfigError, UserError

log = logging.getLogger("moe_tune")

LOCK_NAME = ".lock"
# Locks this process holds, by path: a second Trainer of the same process (a resume in a test, the benchmark's
# variants) reuses its own lock instead of refusing itself.
_HELD: dict[str, RunLock] = {}


class RunLockError(UserError):
    """Another live run holds the output directory."""


class RunLock:
    def __init__(self, output_dir: str):
        self.path = os.path.join(os.path.abspath(output_dir), LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunLockError naming its holder; a dead holder's file is taken over."""
        held = _HELD.get(self.path)
        if held is not None and held.fd is not None:
            self.fd = held.fd
            _HELD[self.path] = self
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd) or "another process"
            os.close(fd)
            raise RunLockError(
                f"{os.path.dirname(self.path)} is in use by {holder} (lock file {self.path}); wait for that run to "
                "end, stop it, or give this run another output_dir"
            ) from None
        previous = _read(fd)
        if previous:
            log.warning("taking over the lock of %s, which is no longer running (%s)", previous, self.path)
        since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        try:
            _write(fd, f"{os.getpid()}@{socket.gethostname()} since {since}\n")
        except OSError:  # a full disk: the lock is not kept by a run that does not start (a Python caller retries)
            os.close(fd)
            raise
        self.fd = fd
        _HELD[self.path] = self

    def release(self) -> None:
        """Empty the file (a clean end leaves nothing to take over) and drop the lock. The file itself stays: an
        unlinked lock file could be locked by one run while the next creates and locks a new one."""
        if self.fd is None:
            return
        if _HELD.get(self.path) is self:
            _write(self.fd, "")
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            del _HELD[self.path]
        self.fd = None


def release_held() -> list[str]:
    """Release every run lock this process holds (the CLI, as a run ends: done, stopped or refused). Returns the
    output directories they locked."""
    released = []
    for lock in list(_HELD.values()):
        released.append(os.path.dirname(lock.path))
        lock.release()
    return released


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace").strip()


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode())
    os.fsync(fd)


def init_run_lock(output_dir: str, rank: int) -> RunLock | None:
    """Rank 0 takes the lock; every rank gets its verdict (a broadcast over all ranks when there is a process
    group) and raises the same RunLockError on failure. Returns rank 0's lock (None on the other ranks)."""
    lock, error = None, None
    if rank == 0:
        lock = RunLock(output_dir)
        try:
            lock.acquire()
        except RunLockError as e:
            error = str(e)
    if dist.is_initialized():
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)  # mesh: all ranks, from rank 0
        error = verdict[0]
    if error is not None:
        raise RunLockError(error)
    return lock


def check_output_dir(output_dir: str) -> None:
    """ConfigError unless ``output_dir`` is a writable directory or can become one: an existing file there (or in
    place of one of its parents), or a directory this process cannot write, would otherwise be an OSError traceback
    from Hydra's or this lock's mkdir."""
    path = os.path.abspath(output_dir)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    where = "" if path == os.path.abspath(output_dir) else f" (under {path})"
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):  # read-only file system or no permission
            raise ConfigError(
                f"output_dir={output_dir}{where} is not writable (a read-only file system or no permission); give an "
                "output_dir you can write to"
            )
        refused = _create_fails(path)
        if refused is not None:
            raise ConfigError(
                f"output_dir={output_dir}{where} is not writable (creating an entry there fails: {refused}); give "
                "an output_dir you can write to"
            )
        return
    where = "is a file" if path == os.path.abspath(output_dir) else f"is under {path}, which is a file"
    raise ConfigError(
        f"output_dir={output_dir} {where}, not a directory; give a directory (an existing one or one to create)"
    )


def _create_fails(directory: str) -> str | None:
    """Why an entry cannot be created in ``directory`` (the OS's words), or None once one was created and removed.
    os.access answers from the permission bits alone, which /proc, /sys and some network or FUSE file systems
    allow (to root) while refusing the mkdir. The probe's name is this process's own: ranks that check the same
    directory at once do not meet."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moe-tune-probe-", dir=directory))
    except OSError as e:
        return e.strerror or str(e)
    return None


__all__ = ["RunLock", "RunLockError", "check_output_dir", "init_run_lock", "release_held"]
