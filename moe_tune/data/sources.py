"""Where records come from: a local file (JSON Lines/JSON, Parquet, CSV, Arrow), a directory of them, a
``datasets`` save_to_disk directory, or a hub name. Each is read lazily, one record at a time, with where it came
from (``file:line`` for JSON Lines, ``file:row N`` otherwise): JSON is read here (the line of a bad record is named
and it alone can be skipped), the rest through ``datasets`` (imported only here, only when data.path is set)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import stat
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from moe_tune.config import DataError
from moe_tune.data.records import BadRecord

EXTENSIONS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")
# The byte-order mark some Windows editors write at the start of a UTF-8 file: not part of the first record.
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Source:
    """One unit of format detection: a file, a save_to_disk directory or a hub dataset."""

    kind: str  # json | parquet | csv | arrow | saved | hub
    path: str
    key: str = "data.path"  # the config key that named it, for error lines (data.val_path for validation records)


def resolve(path: str, key: str = "data.path") -> list[Source]:
    """The sources of ``path``, sorted; DataError naming ``key`` (data.path or data.val_path) if there are none."""
    if os.path.isdir(path):
        if _is_saved(path):
            return [Source("saved", path, key)]
        entries = sorted(n for n in os.listdir(path) if not n.startswith("."))
        for n in entries:
            _refuse_compressed(os.path.join(path, n), f"{key}={path}: its entry {n}", "or move it out of the directory")
        names = [n for n in entries if _kind(n)]
        if not names:
            raise DataError(f"{key}={path} has no {'/'.join(EXTENSIONS)} files and is not a save_to_disk directory")
        if key == "data.path":
            _refuse_held_out(path, names)
        for n in names:  # read as records, a directory, FIFO or device would fail (or never end) mid-read
            what = _not_regular(os.path.join(path, n))
            if what:
                raise DataError(
                    f"{key}={path}: its entry {n} is {what}, not a regular file; move it out of the directory or "
                    f"rename it (every {'/'.join(EXTENSIONS)} entry is read as records)"
                )
        return [Source(_kind(n), os.path.join(path, n), key) for n in names]
    if os.path.isfile(path):
        _refuse_compressed(path, f"{key}={path}", "and give the file it holds")
        if not _kind(path):
            raise DataError(f"{key}={path}: unknown file type; give a {'/'.join(EXTENSIONS)} file or a directory")
        return [Source(_kind(path), path, key)]
    if os.path.lexists(path):  # there, but neither a file nor a directory: /dev/zero, a FIFO, a broken link
        raise DataError(f"{key}={path} is {_not_regular(path)}, not a regular file; give a file or a directory")
    if path.startswith((".", "/", "~")) or _kind(path) or path.count("/") > 1:  # a path, not a hub name
        raise DataError(f"{key}={path} does not exist; give a file, a directory or a hub dataset name (owner/name)")
    return [Source("hub", path, key)]


# Words that name a held-out split in a file's name (Hugging Face datasets reads a directory's splits by them).
HELD_OUT = frozenset({"test", "testing", "eval", "evaluation", "val", "valid", "validation", "dev", "heldout"})


def _refuse_held_out(path: str, names: list[str]) -> None:
    """DataError if a training directory holds files named as a held-out split (test.jsonl, valid-00000.parquet):
    every file of ``data.path`` is trained on, so a test split there would be trained on without a word."""
    held = [n for n in names if HELD_OUT & set(re.split(r"[^a-z]+", os.path.splitext(n)[0].lower()))]
    if not held:
        return
    train = [n for n in names if n not in held]
    use = os.path.join(path, train[0]) if len(train) == 1 else f"{path}/<the training files>"
    raise DataError(
        f"data.path={path} holds {', '.join(held)}, named as a held-out split, and every file there is trained on; "
        f"give data.path={use} and data.val_path={os.path.join(path, held[0])}, or move or rename the held-out files"
    )


def _refuse_compressed(path: str, what: str, fix: str) -> None:
    """DataError if ``path`` is a compressed data file (x.jsonl.gz): read as records it is not, and left out of a
    directory's records it would be lost without a word."""
    stem, ext = os.path.splitext(path)
    if ext.lower() in COMPRESSED and _kind(stem):
        raise DataError(
            f"{what} is a compressed data file, which is not read; decompress it (gunzip, zstd -d, ...) {fix}"
        )


def _kind(name: str) -> str | None:
    return EXTENSIONS.get(os.path.splitext(name)[1].lower())


def _not_regular(path: str) -> str | None:
    """What ``path`` is if not a regular file (after following links): "a directory", "a FIFO", ... or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # a broken or looping link, or an entry we may not stat
        target = f" to {os.readlink(path)}" if os.path.islink(path) else ""
        return f"a link{target} that cannot be followed ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    what = next((name for test, name in kinds if test(mode)), "a special file")
    return f"{what} (a link to {os.path.realpath(path)})" if os.path.islink(path) else what


def _is_saved(path: str) -> bool:
    has = lambda n: os.path.isfile(os.path.join(path, n))  # noqa: E731
    return (has("dataset_info.json") and has("state.json")) or has("dataset_dict.json")


def fingerprint(sources: list[Source]) -> list:
    """What identifies the sources' contents for the cache: paths, sizes and modification times of every file
    (hub datasets: their name; ``hub_fingerprint`` adds the downloaded revision)."""
    out = []
    for s in sources:
        if s.kind == "hub":
            out.append(["hub", s.path, hub_fingerprint(s.path, s.key)])
            continue
        files = [s.path] if os.path.isfile(s.path) else sorted(os.path.join(s.path, n) for n in os.listdir(s.path))
        for f in files:
            st = os.stat(f)
            out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


def iter_records(source: Source, streaming: bool = True) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of ``source``, in file order; a record that cannot be parsed comes as a
    BadRecord instance in place of the record."""
    if source.kind == "json":
        yield from _iter_json(source.path)
        return
    dataset = _open(source, streaming)
    first = 2 if source.kind == "csv" else 1  # CSV: line numbers (a header line, then one line per row)
    prefix = f"{source.path}:" if source.kind == "csv" else f"{source.path}:row "
    try:
        for i, row in enumerate(dataset):
            yield f"{prefix}{i + first}", {k: _without_nulls(v) for k, v in row.items()}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{source.path}: cannot be read ({_one_line(e)})") from None


def _without_nulls(value):
    """``value`` with the null fields of its objects dropped, at every depth. Arrow holds one struct type per column:
    an object of a record (a tool call's arguments, a tool's schema, a message) gets the fields the other records'
    objects have, as nulls, which a chat template would render (a call with arguments it never had). A record's own
    top-level fields keep their nulls (a null field is named as such)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _iter_json(path: str) -> Iterator[tuple[str, object]]:
    with open(path, "rb") as f:
        start = len(BOM) if f.read(len(BOM)) == BOM else 0
        f.seek(start)
        head = f.read(4096).lstrip()
        f.seek(start)
        first = _first_line(f)
        f.seek(start)
        # One JSON array of records: a .json file, or a JSON Lines file whose first line is no record on its own.
        if head.startswith(b"[") and (path.lower().endswith(".json") or not _parses(first[1])):
            yield from _iter_json_array(path, f.read())
            return
        if first[1].strip() == b"{" and head.strip() != b"{":  # json.dump(..., indent=2): no line is JSON alone
            raise DataError(
                f"{path}:{first[0]}: a record spread over several lines (indented JSON); write one record per line "
                "(JSON Lines: json.dumps without indent), or a JSON array of records"
            )
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    f"{path}:{n}",
                    BadRecord("invalid_utf8", f"not valid UTF-8 (byte {raw[e.start]:#04x} at {e.start})"),
                )
                continue
            try:  # without its newline: an error at the line's end is in it, not on json's "line 2"
                record = json.loads(text.rstrip("\r\n"))
                surrogate = _lone_surrogate(record) if "\\u" in text else None
                yield f"{path}:{n}", BadRecord("invalid_utf8", surrogate) if surrogate else record
            except json.JSONDecodeError as e:
                yield f"{path}:{n}", BadRecord("invalid_json", f"not valid JSON ({_json_fault(e)})")
            except RecursionError:  # json's C parser recurses once per nesting level, within Python's limit
                yield f"{path}:{n}", BadRecord("invalid_json", _too_deep())


def _lone_surrogate(record) -> str | None:
    """The fault of a parsed JSON record whose ``\\uXXXX`` escapes left half of a UTF-16 surrogate pair (a cut
    emoji): a string that is no Unicode text, which a tokenizer refuses with a TypeError. None if there is none."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid UTF-8 (\\u{ord(e.object[e.start]):04x}: half of a UTF-16 surrogate pair, no character)"
    return None


def _first_line(f) -> tuple[int, bytes]:
    """(number, bytes) of the first line of ``f`` that is not blank; (0, b"") if there is none."""
    for n, raw in enumerate(f, start=1):
        if raw.strip():
            return n, raw
    return 0, b""


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return True


def _iter_json_array(path: str, raw: bytes) -> Iterator[tuple[str, object]]:
    try:
        records = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        yield f"{path}:byte {e.start}", BadRecord("invalid_utf8", "not valid UTF-8 (the whole JSON array is dropped)")
        return
    except json.JSONDecodeError as e:
        detail = f"not valid JSON ({_json_fault(e)}; the whole JSON array is dropped)"
        yield f"{path}:{e.lineno}", BadRecord("invalid_json", detail)
        return
    except RecursionError:
        yield path, BadRecord("invalid_json", _too_deep("; the whole JSON array is dropped"))
        return
    escapes = b"\\u" in raw
    for i, record in enumerate(records):
        surrogate = _lone_surrogate(record) if escapes else None
        yield f"{path}:record {i + 1}", BadRecord("invalid_utf8", surrogate) if surrogate else record


def _too_deep(more: str = "") -> str:
    return f"not readable JSON (nested more than about {sys.getrecursionlimit()} levels deep{more})"


def _json_fault(e: json.JSONDecodeError) -> str:
    """json's message with the column only: the line is in the record's ``file:line`` (json's own text, "line 1
    column 15 (char 14)", counts lines within the text it was given, which read as a second line number)."""
    return f"{e.msg} at column {e.colno}"


def _open(source: Source, streaming: bool):
    """A ``datasets`` Dataset (or IterableDataset when streaming) of the source's records."""
    import datasets

    datasets.disable_progress_bars()
    if source.kind == "saved":
        loaded = datasets.load_from_disk(source.path)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = _train_split(loaded, source)
        return loaded.to_iterable_dataset() if streaming else loaded
    if source.kind == "hub":
        return _load_hub(source.path, streaming, source.key)
    try:  # local files are read lazily either way: no Arrow copy in the datasets cache
        options = _csv_options(source.path) if source.kind == "csv" else {}
        return datasets.load_dataset(source.kind, data_files=[source.path], split="train", streaming=True, **options)
    except Exception as e:  # the builder's own errors (pyarrow, pandas) for a file it cannot parse
        raise DataError(f"{source.path}: cannot be read as {source.kind} ({_one_line(e)})") from None


def _csv_options(path: str) -> dict:
    """Every CSV column read as text: "15" is a completion, not an int, and "NA" is not missing."""
    import csv

    import datasets

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    return {"features": datasets.Features({n: datasets.Value("string") for n in header}), "keep_default_na": False}


def _train_split(loaded, source: Source):
    if "train" in loaded:
        return loaded["train"]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    raise DataError(
        f"{source.key}={source.path} holds splits {sorted(loaded)} and none is 'train'; point at one split's directory"
    )


# Where one of these is true, datasets reads its cache and never asks the hub (datasets.config.HF_HUB_OFFLINE).
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# With a proxy, the hub's host name is resolved there, not here: no conclusion from a local lookup.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _hub_out_of_reach() -> str | None:
    """Why the hub is known to be out of reach before datasets asks it (its retries take ~30 s to fail): an offline
    variable, or the hub's host name not resolving (no network). None: try the hub."""
    import datasets

    true = ("1", "ON", "YES", "TRUE")
    variable = next((v for v in OFFLINE_VARIABLES if os.environ.get(v, "").upper() in true), None)
    if variable or datasets.config.HF_HUB_OFFLINE:
        variable = variable or "HF_HUB_OFFLINE"
        return f"{variable}={os.environ.get(variable, '1')}"
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    host = urllib.parse.urlparse(datasets.config.HF_ENDPOINT).hostname or "huggingface.co"
    return None if _resolves(host) else f"{host} does not resolve: no network"


@functools.cache
def _resolves(host: str) -> bool:
    """The host name resolves (once per process: the record check and the run each load the dataset)."""
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror:
        return False
    except OSError:  # not a verdict on the network: let datasets try
        return True
    return True


@contextlib.contextmanager
def _offline():
    """datasets and huggingface_hub as under HF_HUB_OFFLINE=1 (both read these flags at each call): a hub dataset
    comes from the datasets cache, at once, or fails at once; no request is made."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_hub(name: str, streaming: bool, key: str = "data.path"):
    """A hub dataset's train split. Where the hub is out of reach (an offline variable, no network): its copy in the
    datasets cache, as datasets reads it offline, or one line saying how to get it."""
    import datasets

    out_of_reach = _hub_out_of_reach()
    try:
        with _offline() if out_of_reach else contextlib.nullcontext():
            return datasets.load_dataset(name, split="train", streaming=streaming)
    except Exception as e:  # no network, a missing repository, no train split: one line with the cause
        if out_of_reach and isinstance(e, ConnectionError):  # offline, as asked or found, and not in the cache
            unset = f", or unset {out_of_reach.split('=')[0]}" if "=" in out_of_reach else ""
            raise DataError(
                f"{key}={name} is not a local file or directory nor in the datasets cache, and the hub is out of "
                f"reach ({out_of_reach}); download it where there is network (hf download {name} --repo-type "
                f"dataset --local-dir <dir>) and give {key}=<dir>/<the folder of its data files>{unset}"
            ) from None
        raise DataError(
            f"{key}={name}: not a local path, and loading it from the hub failed ({_one_line(e)}); "
            "check the name and the network, or give a local path"
        ) from None


def hub_fingerprint(name: str, key: str = "data.path") -> str:
    """The downloaded dataset's fingerprint (its revision and files), for the cache key."""
    return _load_hub(name, streaming=False, key=key)._fingerprint


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
