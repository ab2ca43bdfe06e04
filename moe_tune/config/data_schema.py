"""The data settings (``data.*``) and their choices; ``schema`` holds the rest and re-exports these."""

from __future__ import annotations

from dataclasses import dataclass

from moe_tune.config.constraints import field

DATA_FORMATS = ("auto", "chat", "sharegpt", "alpaca", "prompt_completion", "text")
TRAIN_ON = ("assistant", "all", "last_assistant")
BAD_RECORD_POLICIES = ("error", "skip")
PACKING_STRATEGIES = ("best_fit", "next_fit")


@dataclass
class DataConfig:
    # "arithmetic" is the built-in instruction set (chat records); "random" uniform tokens (benchmarks). Otherwise
    # `path`: a jsonl/json/parquet/csv/arrow file or directory, a `datasets` save_to_disk directory, or a hub name.
    name: str = "arithmetic"
    path: str | None = None
    num_samples: int = 4096
    # Record format, per file: "auto" detects chat (messages), sharegpt (conversations), prompt_completion
    # (prompt + response or completion), text.
    format: str = field("auto", choices=DATA_FORMATS)
    # A Jinja chat template file that replaces the tokenizer's own (chat and sharegpt records).
    chat_template: str | None = None
    # Which tokens carry loss: the assistant turns (prompt_completion: the completion), every token, or only the
    # last assistant turn.
    train_on: str = field("assistant", choices=TRAIN_ON)
    # Field names of prompt_completion and text records.
    prompt_key: str = "prompt"
    response_key: str = "response"
    text_key: str = "text"
    # Pack several samples into one sequence of train.seq_len (each attends only to itself).
    packing: bool = True
    # How samples are placed in rows: "best_fit" (in memory: best-fit decreasing over the whole set; streaming:
    # each sample into the fullest of `packing_buffer` open rows that holds it) or "next_fit" (in order, one open
    # row). best_fit leaves less padding, so fewer rows carry the same tokens.
    packing_strategy: str = field("best_fit", choices=PACKING_STRATEGIES)
    packing_buffer: int = field(64, ge=1, help="open rows while streaming")
    # Read the source lazily (sets larger than memory) instead of loading and tokenizing it up front.
    streaming: bool = False
    # Where tokenized sets are cached (reused across runs and ranks); None: <HF_DATASETS_CACHE or ~/.cache>/moe_tune.
    cache_dir: str | None = None
    # Processes that tokenize (datasets' num_proc).
    num_proc: int = field(1, ge=1)
    # Held-out data: a separate source, or this fraction of the training records (not both).
    val_path: str | None = None
    val_fraction: float = field(0.0, ge=0, lt=1, example="0.01")
    # A record that cannot be used (malformed JSON, bad UTF-8, wrong field types, no trainable token): stop with
    # exit 2 naming the file and line ("error"), or count it in summary.json and go on ("skip").
    on_bad_record: str = field("error", choices=BAD_RECORD_POLICIES)
