"""Tokenized sets on disk, reused across runs and ranks.

An entry is ``<cache_dir>/<key>.pt`` (torch.save of the packed row tensors and the stats), where ``key`` hashes
everything the rows depend on: the source (paths, sizes, modification times of its files; a hub dataset's
fingerprint; the built-in set's name, size and seed), the tokenizer (its vocabulary and rules, special tokens, the
chat template in use), the data options (format, train_on, keys, packing, on_bad_record, the validation split and
seed) and ``train.seq_len``, and the code (a hash of this package's source files). Any change makes a new key;
old entries are never read again (delete the directory to reclaim the space).

One process per node builds an entry (local rank 0) and writes it atomically (a temporary file renamed into
place); with a process group the other ranks wait at a barrier, without one (independent processes) a lock on
``<key>.pt.lock`` serialises builders, so the second finds the first's entry. The lock file is removed by its
holder before it unlocks, so none is left behind (``_lock`` says why that stays safe).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("moe_tune")


def default_cache_dir() -> str:
    root = os.environ.get("HF_DATASETS_CACHE") or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(root, "moe_tune")


def code_version() -> str:
    """A hash of the data package's source: a change to how records become rows invalidates every entry."""
    h = hashlib.sha256()
    here = os.path.dirname(__file__)  # the training chat templates too: they render the records
    for path in sorted(
        glob.glob(os.path.join(here, "*.py")) + glob.glob(os.path.join(here, "chat_templates", "*.jinja"))
    ):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer, template: str | None) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps({k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())})
    h = hashlib.sha256()
    for part in (type(tokenizer).__name__, rules, specials, template or ""):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def cache_key(parts: dict) -> str:
    """sha256 of the JSON of ``parts`` (sorted keys) and the code version."""
    blob = json.dumps({**parts, "code": code_version()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached(cache_dir: str, key: str, build: Callable[[], dict]) -> dict:
    """The entry ``key``: read if present, else built (by local rank 0 when a process group exists) and written."""
    path = os.path.join(cache_dir, f"{key}.pt")
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        log.warning("data.cache_dir=%s cannot be created (%s); tokenizing without a cache", cache_dir, e)
        return build()
    if dist.is_initialized():
        entry = None
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0 and not os.path.isfile(path):
            entry = _write(path, build())
        dist.barrier()  # all ranks: the others read what their node's local rank 0 wrote
        if entry is not None:
            return entry
        return _read(path) if os.path.isfile(path) else build()  # an unwritable cache: every rank builds
    lock = path + ".lock"
    try:
        fd = _lock(lock)
    except OSError as e:  # a cache directory we may read but not write
        log.warning("data.cache_dir=%s cannot be locked (%s); tokenizing without a cache", cache_dir, e)
        return _read(path) if os.path.isfile(path) else build()
    try:
        if os.path.isfile(path):
            return _read(path)
        return _write(path, build())
    finally:
        os.remove(lock)  # before the unlock: a waiter that then gets this lock sees its file gone (_lock)
        os.close(fd)


def _lock(lock_path: str) -> int:
    """The descriptor of ``lock_path``, exclusively flocked. Its holder deletes the file before unlocking, so none
    is left behind; a waiter that gets the lock after that holds a file nobody else can see, so it checks that
    ``lock_path`` is still the file it locked and, if not, locks the new one (the usual unlink-safe flock loop):
    two builders of one entry never overlap."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(lock_path)):
                return fd
        except FileNotFoundError:  # deleted between our lock and the check: lock the next one
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _read(path: str) -> dict:
    # The CLI tokenizes while checking the records, before logging starts: a first run reads its own entry here.
    log.info("tokenized data read from %s (tokenized by this command's record check or an earlier run)", path)
    return torch.load(path, weights_only=True)


def _write(path: str, entry: dict) -> dict:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(entry, tmp)
        os.replace(tmp, path)  # atomic: readers see the whole entry or none
        log.info("tokenized data cached: %s", path)
    except OSError as e:
        log.warning("could not write the data cache %s (%s); the next run tokenizes again", path, e)
        if os.path.exists(tmp):
            os.remove(tmp)
    return entry
