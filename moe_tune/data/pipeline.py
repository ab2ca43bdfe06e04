"""The steps every record goes through, shared by the in-memory and the streaming sets: read (with where it came
from), detect the format of its source, normalise, encode; a record that fails any step is counted in ``Tally``
or stops the run (data.on_bad_record)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator

from moe_tune.config import DataConfig, DataError
from moe_tune.data.encode import IGNORE, Encoder
from moe_tune.data.records import SETTING_FAULTS, BadRecord, detect_format, normalize
from moe_tune.data.templates import RenderTimeout

log = logging.getLogger("moe_tune")

# A source: a function that opens it afresh and yields (where, record or BadRecord).
RecordSource = Callable[[], Iterator[tuple[str, object]]]


def bad_record_message(where: str, bad: BadRecord) -> str:
    if bad.reason in SETTING_FAULTS:  # the detail names the fix
        return f"{where}: {bad.detail}"
    what = "line" if bad.reason in ("invalid_json", "invalid_utf8") else "record"
    fix = f"{bad.fix}, " if bad.fix else ""
    return f"{where}: {bad.detail}; {fix}fix the {what} or set data.on_bad_record=skip"


class Tally:
    """What building a set read, used and skipped. ``stats`` (plain ints and strings, for summary.json):
    records_read, records_used, records_skipped ({reason: count}), first_skipped ({reason: where}),
    records_truncated (longer than train.seq_len, cut), tokens and label_tokens (in the rows), rows, and row_fill
    (tokens / row positions) once packed."""

    def __init__(self, policy: str, seq_len: int):
        self.policy, self.seq_len = policy, seq_len
        self.stats: dict = {
            "records_read": 0,
            "records_used": 0,
            "records_skipped": {},
            "first_skipped": {},
            "records_truncated": 0,
            "tokens": 0,
            "label_tokens": 0,
            "rows": 0,
        }

    def skip(self, where: str, bad: BadRecord) -> None:
        if self.policy == "error" or bad.reason in SETTING_FAULTS:
            raise DataError(bad_record_message(where, bad))
        skipped = self.stats["records_skipped"]
        skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
        self.stats["first_skipped"].setdefault(bad.reason, where)

    def use(self, ids: list[int], labels: list[int]) -> None:
        s = self.stats
        s["records_used"] += 1
        s["records_truncated"] += len(ids) > self.seq_len
        s["tokens"] += min(len(ids), self.seq_len)
        s["label_tokens"] += sum(x != IGNORE for x in labels[: self.seq_len])


def report_stats(name: str, s: dict, warn_truncated: bool = True) -> None:
    """One info line of counts; a warning when records were cut at train.seq_len (``warn_truncated``: the
    user's records, not a built-in set's)."""
    skipped = ", ".join(f"{n} {r} (first: {s['first_skipped'][r]})" for r, n in s["records_skipped"].items())
    log.info(
        "%s: %d records read, %d used%s, %d rows (%.1f%% of their positions real tokens), %d tokens of which %d carry "
        "loss%s",
        name,
        s["records_read"],
        s["records_used"],
        f", {s['records_truncated']} cut to train.seq_len" if s["records_truncated"] else "",
        s["rows"],
        100 * s.get("row_fill", 1.0),
        s["tokens"],
        s["label_tokens"],
        f"; skipped {skipped}" if skipped else "",
    )
    if s["records_truncated"] and warn_truncated:
        log.warning(
            "%s: %d of %d records are longer than train.seq_len and were cut at its end (their later tokens, "
            "later assistant turns included, are not trained on; one far longer is cut by characters before it is "
            "tokenized, which keeps its first train.seq_len tokens); raise train.seq_len to keep them",
            name,
            s["records_truncated"],
            s["records_used"],
        )


def parsed(sources: Iterable[RecordSource], cfg: DataConfig, tally: Tally) -> Iterator[tuple[str, object, str]]:
    """(where, record, format) of every readable record. data.format=auto decides per source, from its first
    record that has the fields of a known format."""
    for source in sources:
        fmt = None if cfg.format == "auto" else cfg.format
        for where, record in source():
            tally.stats["records_read"] += 1
            if isinstance(record, BadRecord):
                tally.skip(where, record)
                continue
            if fmt is None:
                fmt = detect_format(record, cfg) if isinstance(record, dict) else None
                if fmt is None:
                    tally.skip(where, _unknown_format(record, cfg))
                    continue
            yield where, record, fmt


def _unknown_format(record, cfg: DataConfig) -> BadRecord:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    return BadRecord(
        "unknown_format",
        f"no field of a known format (keys: {keys}; chat: messages, sharegpt: conversations, prompt_completion: "
        f"{cfg.prompt_key} + {cfg.response_key}|completion, text: {cfg.text_key}); set data.format or "
        "data.prompt_key/response_key/text_key",
    )


def encode_one(record, fmt: str, cfg: DataConfig, encoder: Encoder):
    """(ids, labels), or the BadRecord that says why not."""
    try:
        return encoder(normalize(record, fmt, cfg))
    except BadRecord as bad:
        return bad
    except RenderTimeout as e:  # the template's fault: stops the run whatever data.on_bad_record says
        return BadRecord("template_timeout", str(e))


def encode_all(items: list[tuple[str, object, str]], cfg: DataConfig, encoder: Encoder, tally: Tally) -> list:
    """Encoded samples of ``items`` in order (bad ones counted or refused); data.num_proc > 1 through
    ``datasets.map`` worker processes."""
    if cfg.num_proc > 1 and len(items) > 1:
        results = _encode_in_workers(items, cfg, encoder)
    else:
        results = (encode_one(record, fmt, cfg, encoder) for _, record, fmt in items)
    out = []
    for (where, _, _), result in zip(items, results):
        if isinstance(result, BadRecord):
            tally.skip(where, result)
        else:
            tally.use(*result)
            out.append(result)
    return out


@contextlib.contextmanager
def _workers_forked_from_a_fresh_process():
    """datasets' worker pool (the ``multiprocess`` package) forks this process by default. Forking a process that
    runs threads (torch's intra-op pool, gloo's and NCCL's) can copy a lock held by one of them into the child,
    which then waits on it forever: the test suite hung so in a 2-worker tokenization after distributed tests.
    ``forkserver`` forks the workers from a fresh single-threaded server process instead (not when ``__main__``
    is no file the server could import, ``python - < script``: there the default stays)."""
    import multiprocess

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        yield
        return
    before = multiprocess.get_start_method(allow_none=True)
    multiprocess.set_start_method("forkserver", force=True)
    try:
        yield
    finally:
        multiprocess.set_start_method(before, force=True)


def _encode_in_workers(items: list, cfg: DataConfig, encoder: Encoder) -> Iterator:
    import datasets

    datasets.disable_progress_bars()
    # Records travel as JSON text: one Arrow type per column whatever their fields (tools, tool calls...).
    table = datasets.Dataset.from_dict(
        {"record": [json.dumps(r, default=str) for _, r, _ in items], "fmt": [f for _, _, f in items]}
    )

    def encode_batch(batch: dict) -> dict:
        encoder.log_notes = False  # its notes travel with the row that made them (a worker's encoder is a copy)
        noted = len(encoder.notes)
        out: dict = {"ids": [], "labels": [], "reason": [], "detail": [], "fix": [], "notes": []}
        for text, fmt in zip(batch["record"], batch["fmt"]):
            result = encode_one(json.loads(text), fmt, cfg, encoder)
            bad = isinstance(result, BadRecord)
            out["ids"].append([] if bad else result[0])
            out["labels"].append([] if bad else result[1])
            out["reason"].append(result.reason if bad else "")
            out["detail"].append(result.detail if bad else "")
            out["fix"].append(result.fix if bad else None)
            out["notes"].append(json.dumps(encoder.notes[noted:]))
            noted = len(encoder.notes)
        encoder.log_notes = True
        return out

    with _workers_forked_from_a_fresh_process():
        mapped = table.map(
            encode_batch, batched=True, num_proc=min(cfg.num_proc, len(items)), remove_columns=["record", "fmt"]
        )
    for row in mapped:
        for level, line in json.loads(row["notes"]):  # each worker notes a check once: said here once in all
            encoder.note(level, line)
        yield BadRecord(row["reason"], row["detail"], row["fix"]) if row["reason"] else (row["ids"], row["labels"])
