"""Loading a checkpoint never runs code from it.

DCP reads ``.metadata`` with plain ``pickle.load`` and the bytes of any non-tensor entry with
``torch.load(weights_only=False)``: a crafted checkpoint could run anything on ``checkpoint.resume=auto`` or
``moe-tune-export``. Here ``.metadata`` goes through an unpickler that admits only DCP's own metadata classes
(and the few torch and standard-library types they hold), in the spirit of ``torch.load(weights_only=True)``;
non-tensor entries are read with ``weights_only=True``; shard names must be plain files of the checkpoint
directory. Tensor data DCP already reads with ``weights_only=True``.

TransformerEngine's FP8 delayed-scaling extra state is a pickle too, which TE unpickles itself only with
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``. ``check_extra_state`` first runs each such payload through an
allowlisting unpickler (TE's recipe classes, tensors, containers); only when every payload passes does the load
set that opt-in (``_te_pickled_extra_state_allowed`` in moe_tune.checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moe_tune.checkpoint import manifest
from moe_tune.config import CheckpointError, UserError
from moe_tune.distributed import shard

METADATA = ".metadata"
log = logging.getLogger("moe_tune")
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name ("torch.strided"), as weights_only admits it
    "torch": {"Size", "device"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytearray", "complex"},
}
_TE_EXTRA_CLASSES = {
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor"},
    "torch.storage": {"_load_from_bytes"},  # replaced by a weights_only load below
    **_DCP_CLASSES,
}


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that would run code or reach outside its directory when loaded: never loaded, never
    skipped silently (``checkpoint.resume=auto`` does not fall back past it)."""


class _Disallowed(pickle.UnpicklingError):
    """A global or payload outside the allowlist (other unpickling errors are damage, not danger)."""


def _weights_only_bytes(data: bytes):
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001  (torch.load's refusal comes as several types)
        raise _Disallowed(f"a nested torch.save payload is not allowed under weights_only ({e})") from None


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict[str, set[str]]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "transformer_engine.common.recipe" and "torch._utils" in self.allowed:
            obj = super().find_class(module, name)  # TE's recipe dataclasses and enums: data, no behaviour on load
            if isinstance(obj, type):
                return obj
        if name in self.allowed.get(module, ()):
            if (module, name) == ("torch.storage", "_load_from_bytes"):
                return _weights_only_bytes
            return super().find_class(module, name)
        raise _Disallowed(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid):
        raise _Disallowed("persistent ids are not allowed")


def _refuse(path: str, why: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"refusing to load {path}: {why}; it is not a checkpoint moe-tune wrote (or was altered). "
        "Delete it and use another checkpoint (checkpoint.resume=<path>)"
    )


def read_metadata(checkpoint: str):
    """DCP's ``Metadata`` of ``checkpoint``, unpickled through the allowlist and checked: UnsafeCheckpoint for a
    disallowed class or a shard outside the directory, CheckpointError for a missing or unreadable file."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(checkpoint, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _AllowlistUnpickler(f, _DCP_CLASSES).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except _Disallowed as e:
        raise _refuse(path, str(e)) from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} is unreadable ({e}): the checkpoint is corrupt") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}): the checkpoint is corrupt") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise _refuse(path, f"it holds a {type(metadata).__name__}, not DCP metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise _refuse(path, f"it names a shard outside the checkpoint directory ({name!r})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``read_metadata`` through the allowlist."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state_dict: dict, checkpoint: str) -> None:
    """``dcp.load`` of ``checkpoint`` into ``state_dict`` in place, without unpickling anything unsafe."""
    import torch.distributed.checkpoint as dcp

    read_metadata(checkpoint)  # its errors as CheckpointError here, not wrapped by DCP's collectives
    with warnings.catch_warnings():
        # One process without a group (moe-tune-export, from_pretrained) is intended: DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state_dict, storage_reader=SafeReader(checkpoint), planner=SafePlanner())


def check_extra_state(state: dict, path: str) -> None:
    """No pickled extra-state payload (uint8 tensors) in ``state`` names a global outside the allowlist (TE's
    recipe classes, tensors, containers): UnsafeCheckpoint naming ``path`` and the key otherwise. A payload that
    is not a valid pickle passes: plain ``pickle.loads`` fails on it at the same opcode, having resolved only the
    same allowed globals (TE then reports it)."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        data = value.detach().cpu().numpy().tobytes()
        try:
            _AllowlistUnpickler(io.BytesIO(data), _TE_EXTRA_CLASSES).load()
        except _Disallowed as e:
            raise _refuse(f"{path} ({key})", str(e)) from None
        except Exception:  # noqa: BLE001, S110  (damage, not danger: see above)
            pass


def check_finite(named, what: str) -> None:
    """Collective: CheckpointError naming the first floating-point tensor of ``named`` ((name, tensor) pairs,
    DTensor shards included) that holds NaN or inf on any rank. One pass over the tensors, before training."""
    import torch.distributed as dist

    bad = []
    for name, t in named:
        local = shard.local(t)
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            if not bool(torch.isfinite(local).all()):  # host sync: once per tensor, at load time only
                bad.append(name)
                break
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)  # all ranks: every rank raises, or none does
        bad = [n for part in gathered for n in part]
    if bad:
        raise CheckpointError(
            f"{what}: tensor {bad[0]} holds NaN or inf values; the file is damaged or was saved after a divergence. "
            "Use another checkpoint (or a fresh copy of the model)"
        )


# What a write the filesystem refused raises (errno, its text, safetensors' "os error N"), and the line's words for
# it: a full disk, this user's quota on a shared filesystem (EDQUOT: Lustre, GPFS and NFS home directories), or a
# filesystem remounted read-only under the run (a storage fault).
_OUT_OF_ROOM = (
    (errno.ENOSPC, "No space left", "os error 28", "no space left on device"),
    (errno.EDQUOT, "Disk quota exceeded", "os error 122", "disk quota exceeded"),
    (errno.EROFS, "Read-only file system", "os error 30", "read-only file system"),
)


def _disk_full(exc: BaseException) -> str | None:
    """What ran out ("no space left on device", "disk quota exceeded") anywhere in ``exc``'s chain or in DCP's
    per-rank failures (torch.save reports a full disk as ``unexpected pos``: a RuntimeError, its OSError lost);
    None for any other failure."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for code, text, os_error, words in _OUT_OF_ROOM:
            if isinstance(e, OSError) and e.errno == code or text in str(e) or os_error in str(e):
                return words
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) else f)
        todo += [e.__cause__, e.__context__]
    return None


def _free_up(words: str, where: str) -> str:
    """The fix of a write the filesystem of ``where`` refused."""
    if "read-only" in words:
        return f"Make {where} writable again (or give an output_dir elsewhere)"
    return f"Free space in {where}" + (" (or have the quota raised)" if "quota" in words else "")


@contextlib.contextmanager
def disk_full_exits(path: str, previous: str | None, rank: int):
    """A save of ``path`` that runs out of disk space: its partial directory removed (it never had COMPLETE),
    one error line naming the path and the checkpoint resume would use, exit 1 (a failure of the machine, not
    of the user's input)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        words = _disk_full(e)
        if words is None and "unexpected pos" in str(e) and _free_bytes(path) < 64 << 20:
            words = "no space left on device"  # torch.save's full disk, its OSError lost
        if words is None:
            raise
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            kept = (
                f"the previous checkpoint {previous} is intact (checkpoint.resume=auto continues from it)"
                if previous
                else "there is no earlier checkpoint"
            )
            log.error(
                "saving checkpoint %s failed: %s (%d MiB free); nothing of it was kept and %s. %s, then resume",
                path,
                words,
                _free_bytes(path) >> 20,
                kept,
                _free_up(words, os.path.dirname(path)),
            )
        raise SystemExit(1) from None


@contextlib.contextmanager
def disk_full_ends_run(output_dir: str, settle: Callable[[], object]):
    """A write of the run outside a checkpoint save (the lock, the built base model, a metrics row, the summary, a
    tracker's file) that runs out of disk space: one error line naming the file, the free space and the checkpoint
    resume would use, exit 1, as for a save. ``settle`` first waits for the save in flight (the saver's ``wait``):
    complete, it is the one named; cut short by the same full disk, the save's own line and exit 1 are said instead.
    Not only OSError: safetensors reports a full disk as a SafetensorError naming ``os error 28``."""
    try:
        yield
    except Exception as e:
        words = None if isinstance(e, UserError) else _disk_full(e)  # a value to fix keeps its own line and exit 2
        if words is None:
            raise
        settle()
        newest = next(iter(manifest.complete_checkpoints(output_dir)), None)
        kept = f"{newest} is intact (checkpoint.resume=auto continues from it)" if newest else "no checkpoint was saved"
        print(
            f"moe-tune: error: writing {getattr(e, 'filename', None) or output_dir} failed: {words} "
            f"({_free_bytes(output_dir) >> 20} MiB free); {kept}. {_free_up(words, output_dir)}, then resume",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


def export_disk_full(exc: BaseException, out_dir: str, kept: str, fix: str) -> str | None:
    """The one line for an export to ``out_dir`` that ran out of disk space (its partial directory already removed
    by ``write_checkpoint_atomic``); None for any other failure. ``kept``: what is intact; ``fix``: what to run
    once space is freed. Safetensors reports a full disk as a SafetensorError naming ``os error 28``."""
    words = None if isinstance(exc, (SystemExit, KeyboardInterrupt)) else _disk_full(exc)
    if words is None:
        return None
    return (
        f"exporting to {out_dir} failed: {words} ({_free_bytes(out_dir) >> 20} MiB free); nothing of it was kept "
        f"and {kept}. {_free_up(words, os.path.dirname(os.path.abspath(out_dir)))}, then {fix}"
    )


@contextlib.contextmanager
def export_disk_full_exits(out_dir: str, run_dir: str, step: int, rank: int = 0):
    """A run's export to ``out_dir`` (after training to ``step``) that runs out of disk space on any rank (every
    rank raises it: ``export.end_together``): one error line from rank 0 naming the checkpoints kept and how to
    export again, exit 1 on every rank, as for a checkpoint save."""
    try:
        yield
    except BaseException as e:
        newest = next(iter(manifest.complete_checkpoints(run_dir)), None)
        if newest is None:
            kept, fix = "the run saved no checkpoint", "run the same command again (it trains again from step 1)"
        else:
            kept = f"the checkpoints are intact (newest: {newest})"
            fix = "run the same command again (it resumes from that checkpoint and exports)"
            if manifest.saved_step(newest) == step:
                fix += f", or moe-tune-export {newest} {out_dir}"
        line = export_disk_full(e, out_dir, kept, fix)
        if line is None:
            raise
        if rank == 0:
            log.error("%s", line)
        raise SystemExit(1) from None


def _free_bytes(path: str) -> int:
    parent = path
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return shutil.disk_usage(parent or ".").free
