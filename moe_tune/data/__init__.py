"""Instruction data: built-in generated tasks or a local jsonl/parquet file or directory, tokenized with
the model's tokenizer, prompt tokens masked from the loss, packed into fixed-length rows."""

from moe_tune.data.loader import PackedDataset, build_dataset

__all__ = ["PackedDataset", "build_dataset"]
