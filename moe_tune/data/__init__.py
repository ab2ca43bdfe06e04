"""Fine-tuning data: the built-in generated tasks, or records from files, ``datasets`` save_to_disk directories or
hub names (chat, ShareGPT, prompt/completion or plain text; ``data.format=auto`` detects per file), rendered with
the tokenizer's chat template, loss-masked by ``data.train_on``, packed into rows of ``train.seq_len``.

The trainer calls ``build_datasets(cfg.data, tokenizer, seq_len, seed, vocab_size) -> (train, val | None)``;
see its docstring for the two objects' APIs."""

from moe_tune.data.loader import build_dataset, build_datasets
from moe_tune.data.packing import PackedDataset, ValDataset
from moe_tune.data.sources import resolve


def check_data_sources(cfg) -> None:
    """``data.path`` and ``data.val_path`` name files, directories or hub datasets that exist (DataError naming
    the path otherwise): checked before a run writes anything. Hub names are checked when loaded."""
    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path is not None:
            resolve(path, key)


__all__ = ["PackedDataset", "ValDataset", "build_dataset", "build_datasets", "check_data_sources"]
