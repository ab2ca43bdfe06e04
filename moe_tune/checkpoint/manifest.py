"""The integrity manifest in a checkpoint's ``COMPLETE`` file, and picking the checkpoint to resume from.

``COMPLETE`` is JSON, written last (rank 0, write-then-rename, after every rank's files are on disk)::

    {"step": 4, "format": 1, "hash": "crc32",
     "files": {".metadata": {"size": 1234, "crc32": "9a3c01f2"}, "__0_0.distcp": {...}, "meta.json": {...}}}

It lists every file of the directory but itself. The checksum is zlib's CRC-32, streamed in 16 MiB blocks: it is
for bit rot, truncation and torn copies, not tampering (``moe_tune.checkpoint.safe`` keeps a crafted file from
running code). CRC-32 because it is the fastest of the hashes Python ships (several times blake2b and sha1 per
core); the work is split evenly over the ranks (each hashes every world-th file) at save and again at load. Sizes
are always checked; ``verify(..., checksums=False)`` skips the hashing.

A ``COMPLETE`` holding only the step number (checkpoints written before the manifest) still loads, with a
warning that it cannot be checked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from moe_tune.config import CheckpointError
from moe_tune.distributed.process_group import rank_world
from moe_tune.run_record import write_json

COMPLETE = "COMPLETE"
FORMAT = 1
_BLOCK = 16 << 20
log = logging.getLogger("moe_tune")
_warned_unchecked: set[str] = set()  # one warning per old checkpoint and process


def crc32(path: str) -> str:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def fsync(path: str) -> None:
    """``path``'s bytes (a file) or entries (a directory) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather(local: list, group=None) -> list:
    """Every rank's ``local`` items, concatenated in rank order, on every rank (``group``: all ranks, the
    default group or the checkpoint writer's)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)  # all ranks
    return [item for part in out for item in part]


def write_complete(path: str, step: int, group=None) -> dict:
    """Collective on ``group`` (all ranks), after every rank's files of ``path`` are written and fsync'd: hash
    them (each rank every world-th file, up to 8 at once; just written, they are read from the page cache), then rank 0 writes
    ``COMPLETE`` atomically and fsyncs the directory. Returns the manifest's files."""
    rank, world = rank_world()
    names = sorted(n for n in os.listdir(path) if n != COMPLETE and not n.startswith(COMPLETE))
    mine = names[rank::world]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(mine)))) as pool:  # zlib and reads release the GIL
        sums = list(pool.map(lambda n: crc32(os.path.join(path, n)), mine))
    mine = [(n, {"size": os.path.getsize(os.path.join(path, n)), "crc32": c}) for n, c in zip(mine, sums)]
    files = dict(_gather(mine, group))
    if rank == 0:
        body = {"step": step, "format": FORMAT, "hash": "crc32", "files": dict(sorted(files.items()))}
        write_json(os.path.join(path, COMPLETE), body)
        fsync(path)  # the renames into the directory (meta.json, .metadata, COMPLETE) are on disk too
    return files


def read_manifest(path: str) -> dict | None:
    """The ``files`` of ``path``'s manifest; None for an old ``COMPLETE`` that holds only the step."""
    with open(os.path.join(path, COMPLETE)) as f:
        text = f.read()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("files"), dict):
        return body["files"]
    if isinstance(body, int) or text.strip().isdigit():
        return None
    raise CheckpointError(f"{os.path.join(path, COMPLETE)} is corrupt (neither a manifest nor a step number)")


def _check_file(path: str, name: str, entry: dict, checksums: bool) -> str | None:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return f"{file} is missing"
    size = os.path.getsize(file)
    if size != entry.get("size"):
        return f"{file} has {size} bytes, the manifest says {entry.get('size')} (truncated or replaced)"
    if checksums and crc32(file) != entry.get("crc32"):
        return f"{file} fails its checksum (crc32 {crc32(file)}, the manifest says {entry.get('crc32')})"
    return None


def verify(path: str, checksums: bool = True) -> str | None:
    """Collective: None if ``path`` is intact, else what is wrong with its first bad file (the same on every
    rank). Each rank checks every world-th file."""
    rank, world = rank_world()
    try:
        files = read_manifest(path)
    except (OSError, CheckpointError) as e:
        files, problems = {}, [str(e)]
    else:
        problems = []
    if files is None:
        if rank == 0 and path not in _warned_unchecked:
            _warned_unchecked.add(path)
            log.warning("%s has no integrity manifest (written by an older moe-tune): its files are not checked", path)
        files = {n: None for n in (".metadata", "meta.json")}
    names = sorted(files)
    for name in names[rank::world]:
        entry = files[name]
        problem = (
            (None if os.path.isfile(os.path.join(path, name)) else f"{os.path.join(path, name)} is missing")
            if entry is None
            else _check_file(path, name, entry, checksums)
        )
        if problem:
            problems.append(problem)
    problems = _gather(problems)
    return problems[0] if problems else None


def _step_dirs(run_dir: str) -> list[tuple[int, str, bool]]:
    """(N, path, complete) for every ``checkpoints/step_<N>`` of ``run_dir``, newest (highest N) first."""
    root = os.path.join(run_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := re.fullmatch(r"step_(\d+)", n))]
    return [(step, p, os.path.isfile(os.path.join(p, COMPLETE))) for step, p in sorted(found, reverse=True)]


def complete_checkpoints(run_dir: str) -> list[str]:
    """Every ``checkpoints/step_<N>`` of ``run_dir`` with a ``COMPLETE`` file, newest (highest N) first."""
    return [p for _, p, complete in _step_dirs(run_dir) if complete]


def saved_step(path: str) -> int | None:
    """The step in ``path``'s ``COMPLETE`` (a manifest, or an old file holding the number); None if unreadable."""
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return None
    step = body.get("step") if isinstance(body, dict) else body
    return step if isinstance(step, int) else None


def _incomplete_after(run_dir: str, path: str | None) -> list[str]:
    """The ``checkpoints/step_<N>`` of ``run_dir`` without ``COMPLETE`` newer than ``path`` (all of them when
    None): saves cut short (a kill during them), which a resume passes over."""
    dirs = _step_dirs(run_dir)
    after = next((step for step, p, _ in dirs if p == path), -1)
    return [p for step, p, complete in dirs if not complete and step > after]


def _say_passed_over(run_dir: str, path: str | None) -> None:
    """One warning (rank 0) naming the incomplete checkpoints newer than the one resumed from: the steps after it
    are trained again."""
    skipped = _incomplete_after(run_dir, path)
    if skipped and rank_world()[0] == 0:
        then = f"resuming from {path}" if path is not None else "no complete checkpoint: starting at step 0"
        log.warning("passing over incomplete checkpoint %s (a save cut short); %s", ", ".join(skipped), then)


def prune(run_dir: str, keep: int, saved: int) -> list[str]:
    """Once step ``saved`` is saved: delete the complete checkpoints up to it beyond the newest ``keep`` (0: none).
    Each loses its ``COMPLETE`` file first, so one that is only partly deleted (a crash meanwhile) is never resumed
    from. Returns the deleted paths. Incomplete directories (a save cut short) are left as they are, and so are
    complete ones past ``saved`` (damaged, passed over by the resume): counted, they would push out the save just
    written and the one resumed from, leaving a resume nothing intact."""
    import shutil

    upto = [p for n, p, complete in _step_dirs(run_dir) if complete and n <= saved]
    old = upto[keep:] if keep > 0 else []
    for path in old:
        os.remove(os.path.join(path, COMPLETE))
        shutil.rmtree(path)
    return old


def later_checkpoints(run_dir: str, step: int) -> list[str]:
    """The complete checkpoints of ``run_dir`` past ``step``, newest first."""
    return [p for n, p, complete in _step_dirs(run_dir) if complete and n > step]


def pick(run_dir: str, resume: str, checksums: bool = True) -> str | None:
    """The checkpoint ``checkpoint.resume`` names, checked (collective). ``auto``: the newest intact one, one
    warning line per damaged one passed over, None when there is none; CheckpointError naming the damage when
    every one is damaged. A path: CheckpointError when it is incomplete or damaged."""
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, COMPLETE)):
            raise CheckpointError(f"checkpoint.resume={resume} is not a complete checkpoint (no {COMPLETE} file)")
        problem = verify(resume, checksums)
        if problem:
            raise CheckpointError(f"checkpoint.resume={resume} is damaged: {problem}; give another checkpoint")
        return resume
    candidates = complete_checkpoints(run_dir)
    problems = []
    for path in candidates:
        problem = verify(path, checksums)
        if problem is None:
            _say_passed_over(run_dir, path)
            return path
        problems.append(problem)
        if rank_world()[0] == 0:
            log.warning("checkpoint %s is damaged (%s); trying the one before it", path, problem)
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {os.path.join(run_dir, 'checkpoints')}: {'; '.join(problems)}; "
            "remove the damaged ones to start afresh, or give checkpoint.resume=none"
        )
    _say_passed_over(run_dir, None)
    return None
