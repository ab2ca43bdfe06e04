"""``build_datasets``: the training set and the validation set of a run, tokenized once and cached (or streamed)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import cache
from moe_tune.data.encode import Encoder, read_template
from moe_tune.data.packing import PackedDataset, ValDataset, pack_rows, random_dataset
from moe_tune.data.pipeline import RecordSource, Tally, encode_all, parsed, report_stats

log = logging.getLogger("moe_tune")


def build_datasets(
    cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int | None = None
) -> tuple[PackedDataset, ValDataset | None]:
    """The training set and the validation set (None without data.val_path / data.val_fraction).

    train: ``micro_batch(step, micro, layout, dp_rank, device)`` -> (ids, labels, position ids or None),
    [layout.micro_batch_size, seq_len] each; the rows of a step depend only on (seed, step, micro, dp_rank, the
    ``BatchLayout``), so resuming at a step is exact. In memory (``PackedDataset``) or, with data.streaming=true,
    read lazily (``StreamingDataset``, same method).
    val: ``ValDataset`` (always in memory): ``batches(layout, dp_rank, device)`` yields (ids, labels, position ids
    or None) and covers every val row exactly once over the ranks, the same number of batches on every rank
    (``num_batches(layout)``; padding rows have labels -100 only);
    ``num_label_tokens`` counts its label tokens (causal shift: labels[:, 1:] != -100).
    Both carry ``stats`` (records_read, records_used, records_skipped {reason: n}, first_skipped {reason:
    where}, records_truncated, tokens, label_tokens, rows): put ``train.stats`` into summary.json.

    Tokenization is cached in data.cache_dir (see moe_tune.data.cache): a restart, or another rank, reads it."""
    if cfg.name == "random" and cfg.path is None:
        return random_dataset(max(cfg.num_samples, 1), seq_len, vocab_size or len(tokenizer), seed), None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if cfg.streaming:
        from moe_tune.data.streaming import StreamingDataset

        sources = record_sources(cfg, cfg.path, seed, streaming=True)
        train = StreamingDataset(sources, cfg, Encoder(tokenizer, cfg, seq_len), pad, seed)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.info(  # the in-memory sets' counts line comes at the end instead (summary.json's data_stats)
                "data (train, streamed): %d file(s) of %s read as the steps need them; records are counted as read, "
                "in summary.json's data_stats at the end",
                len(sources),
                cfg.path,
            )
        val = _cached(cfg, tokenizer, seq_len, seed, with_train=False)
        val_set = ValDataset(*val["val"][:3], pad, val["val_stats"]) if val["val"] is not None else None
    else:
        entry = _cached(cfg, tokenizer, seq_len, seed, with_train=True)
        ids, labels, positions, lengths = entry["train"]
        train = PackedDataset(ids, labels, positions, seed, entry["train_stats"], lengths)
        val_set = ValDataset(*entry["val"][:3], pad, entry["val_stats"]) if entry["val"] is not None else None
    train.chat_template = read_template(cfg.chat_template) if cfg.chat_template else None
    return train, val_set


def build_dataset(cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int | None = None) -> PackedDataset:
    """The training set of ``build_datasets``."""
    return build_datasets(cfg, tokenizer, seq_len, seed, vocab_size)[0]


def record_sources(cfg: DataConfig, path: str | None, seed: int, streaming: bool = False) -> list[RecordSource]:
    """The sources of ``path`` (None: the built-in set), each re-openable. Local files are read lazily either way;
    a hub dataset is streamed from the hub, or read from its download (the one the cache key fingerprinted)."""
    if path is None:
        if cfg.name != "arithmetic":
            raise DataError(f"data={cfg.name!r} is not built in (arithmetic); or set data.path=<file|dir|hub name>")
        return [lambda: _builtin_records(cfg, seed)]
    from moe_tune.data.sources import iter_records, resolve

    return [lambda s=s: iter_records(s, streaming) for s in resolve(path, _key(cfg, path))]


def _policy(cfg: DataConfig) -> str:
    """The built-in set's records are generated, not the user's to fix: those that do not fit train.seq_len
    (the template's tokens plus a long question) are skipped and counted, whatever data.on_bad_record says."""
    return "skip" if cfg.path is None else cfg.on_bad_record


def _builtin_records(cfg: DataConfig, seed: int) -> Iterator[tuple[str, dict]]:
    from moe_tune.data.builtin import arithmetic_samples

    for i, record in enumerate(arithmetic_samples(cfg.num_samples, seed)):
        yield f"data={cfg.name} record {i + 1}", record


def _source_fingerprint(cfg: DataConfig, path: str | None, seed: int) -> list | None:
    if path is None:
        return [cfg.name, cfg.num_samples, seed]  # the built-in set is generated from the seed
    from moe_tune.data.sources import fingerprint, resolve

    return fingerprint(resolve(path, _key(cfg, path)))


def _key(cfg: DataConfig, path: str) -> str:
    """The config key that named ``path``, for error lines."""
    return "data.path" if path == cfg.path else "data.val_path"


def _cached(cfg: DataConfig, tokenizer, seq_len: int, seed: int, with_train: bool) -> dict:
    """The cache entry of the in-memory set(s): {"train", "train_stats", "val", "val_stats"}."""
    encoder = Encoder(tokenizer, cfg, seq_len)
    parts = {
        "train": _source_fingerprint(cfg, cfg.path, seed) if with_train else None,
        "val": _source_fingerprint(cfg, cfg.val_path, seed) if cfg.val_path else None,
        "val_split": [cfg.val_fraction, seed] if cfg.val_fraction > 0 else None,
        "tokenizer": cache.tokenizer_fingerprint(tokenizer, encoder.template),
        "options": [
            cfg.format,
            cfg.train_on,
            cfg.prompt_key,
            cfg.response_key,
            cfg.text_key,
            cfg.packing,
            cfg.packing_strategy,
        ],
        "on_bad_record": cfg.on_bad_record,
        "seq_len": seq_len,
    }
    if not with_train and cfg.val_path is None:
        return {"val": None}
    key = cache.cache_key(parts)
    built: list[bool] = []
    entry = cache.cached(
        cfg.cache_dir or cache.default_cache_dir(),
        key,
        lambda: built.append(True) or _build(cfg, encoder, seed, with_train),
    )
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for level, line in entry.get("notes", []) if rank0 and not built else []:  # said when they were tokenized
        log.log(level, "%s", line)
    user_data = {"train": cfg.path is not None, "val": (cfg.val_path or cfg.path) is not None}
    labels = {name: f"data ({name})" for name in ("train", "val")}
    if cfg.val_path is None and cfg.val_fraction > 0 and entry.get("train_stats"):  # records read once, then split
        held, kept = entry["val_stats"]["records_read"], entry["train_stats"]["records_read"]
        labels["train"] = (
            f"data (train; data.val_fraction={cfg.val_fraction:g} held out {held} of {held + kept} records)"
        )
        labels["val"] = "data (val, held out by data.val_fraction)"
    for name in ("train", "val"):
        if rank0 and entry.get(f"{name}_stats"):
            report_stats(labels[name], entry[f"{name}_stats"], warn_truncated=user_data[name])
    return entry


def _build(cfg: DataConfig, encoder: Encoder, seed: int, with_train: bool) -> dict:
    train_tally, val_tally = Tally(_policy(cfg), encoder.seq_len), Tally(cfg.on_bad_record, encoder.seq_len)
    items = list(parsed(record_sources(cfg, cfg.path, seed), cfg, train_tally)) if with_train else []
    val_items = None
    if cfg.val_path is not None:
        val_items = list(parsed(record_sources(cfg, cfg.val_path, seed), cfg, val_tally))
    elif cfg.val_fraction > 0:
        items, val_items = split_val(items, cfg.val_fraction, seed)
        train_tally.stats["records_read"] -= len(val_items)
        val_tally.stats["records_read"] = len(val_items)
    entry: dict = {"train": None, "train_stats": None, "val": None, "val_stats": None, "notes": encoder.notes}
    if with_train:
        entry["train"] = _rows(items, cfg, encoder, train_tally, cfg.path or f"data={cfg.name}")
        entry["train_stats"] = train_tally.stats
    if val_items is not None:
        entry["val"] = _rows(val_items, cfg, encoder, val_tally, cfg.val_path or "data.val_fraction")
        entry["val_stats"] = val_tally.stats
    return entry


def _rows(items: list, cfg: DataConfig, encoder: Encoder, tally: Tally, where: str) -> tuple:
    pad = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else 0
    rows = pack_rows(encode_all(items, cfg, encoder, tally), encoder.seq_len, pad, cfg.packing, cfg.packing_strategy)
    tally.stats["rows"] = int(rows[0].shape[0])
    tally.stats["row_fill"] = float(rows[3].sum()) / max(rows[0].numel(), 1)
    if not tally.stats["rows"]:
        raise DataError(f"{where}: no usable records ({_counts(tally.stats)}); {_fix(tally.stats, encoder)}")
    return rows


def _fix(stats: dict, encoder: Encoder) -> str:
    """What to change when no record was usable: records to read, a longer row, or the skipped records."""
    skipped = stats["records_skipped"]
    if not stats["records_read"]:
        return "give a source with records"
    if set(skipped) == {"no_trainable_token"}:
        return (
            f"no record has a token that carries loss within train.seq_len={encoder.seq_len}: raise train.seq_len "
            f"or check data.train_on={encoder.train_on}"
        )
    return "see data.on_bad_record"


def _counts(stats: dict) -> str:
    skipped = ", ".join(f"{r}: {n}" for r, n in stats["records_skipped"].items()) or "none"
    return f"{stats['records_read']} read, skipped {skipped}"


def split_val(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, val): a seeded random ``fraction`` of ``items`` (at least one) held out, both in source order."""
    if len(items) < 2:
        raise DataError(f"data.val_fraction={fraction} needs at least 2 usable records, got {len(items)}")
    g = torch.Generator().manual_seed(seed)
    num_val = min(len(items) - 1, max(1, round(len(items) * fraction)))
    held = set(torch.randperm(len(items), generator=g)[:num_val].tolist())
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


__all__ = ["build_dataset", "build_datasets", "record_sources", "split_val"]
