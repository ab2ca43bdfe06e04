"""A run's values and files, checked before Hydra creates its run directory (a bad one is one line, exit 2, and
nothing written), and that directory put back as the command found it when the trainer refuses a value later."""

from __future__ import annotations

import logging
import os

from moe_tune.config.overrides import to_config

# output_dir's entries before Hydra creates it (None: it did not exist), for restore_output_dir.
_BEFORE: dict[str, set[str] | None] = {}


def restore_output_dir(output_dir: str) -> None:
    """A one-process run refused while setting up (a value found bad once the model is known) leaves output_dir
    as the command found it: the lock file and the base model it created there go (an earlier base model it
    replaced comes back), and the directory too if Hydra created it for this run and nothing else is in it. With
    more ranks they stay: another rank may still be reading the base model rank 0 built, and no collective is safe
    on an error path."""
    import shutil

    from moe_tune.distributed.env import dist_env
    from moe_tune.models.base_model import BASE_MODEL, restore_base_model
    from moe_tune.train.lock import LOCK_NAME

    path = os.path.abspath(output_dir)
    if path not in _BEFORE or dist_env().world_size > 1 or not os.path.isdir(path):
        return
    restore_base_model(path)
    before, ours = _BEFORE[path], {LOCK_NAME, BASE_MODEL}
    if before is None and set(os.listdir(path)) <= ours:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in ours - (before or set()):  # what this run created (a model=hf run builds no base model)
        entry = os.path.join(path, name)
        if os.path.isdir(entry):
            shutil.rmtree(entry, ignore_errors=True)
        elif os.path.lexists(entry):
            os.remove(entry)


def check_inputs(dict_cfg, world_known: bool, here: bool = True) -> None:
    """The values and the model files, before Hydra creates the run directory: a bad one leaves nothing written.
    With the world size known (not a sweep, whose launcher picks it), the trainer's whole check runs here; a
    sweep's jobs that run ``here`` (Hydra's basic launcher: this process's world and packages) are checked for
    the layout and the backends too, before the first job trains."""
    from moe_tune.loggers import require_logger

    cfg = to_config(dict_cfg)
    require_logger(cfg.logger)  # no import: a missing tracker package is said before torch and the model load
    if cfg.checkpoint.resume not in ("auto", "none"):
        from moe_tune.checkpoint.read import check_resume_path  # torch: only for a path given

        check_resume_path(cfg.checkpoint.resume)
    if world_known:
        from moe_tune.train import Trainer

        path = os.path.abspath(cfg.output_dir)
        _BEFORE[path] = set(os.listdir(path)) if os.path.isdir(path) else None

        Trainer.check_config(cfg)
        check_records(cfg)
    else:
        from moe_tune.build import check_model_source
        from moe_tune.config.validate import check_values
        from moe_tune.data import check_data_sources
        from moe_tune.train.lock import check_output_dir

        check_values(cfg)
        check_output_dir(cfg.output_dir)  # the sweep's runs write under it
        if here:
            from moe_tune.config import validate
            from moe_tune.env import require_backends

            validate(cfg)
            require_backends(cfg)
        check_model_source(cfg)
        check_data_sources(cfg)


def check_records(cfg) -> None:
    """Read and encode the training and validation records (not a streamed set, read as the run goes): a bad
    record is one line and exit 2 with nothing written. The tokenized set lands in data.cache_dir, where the
    trainer finds it (same records, options and tokenizer: the model's own, or the built-in one a preset's
    base_model/ holds a copy of)."""
    from moe_tune.build import build_tokenizer
    from moe_tune.data import build_datasets

    data = cfg.data
    if data.streaming or (data.name == "random" and data.path is None):
        return
    quiet = logging.getLogger("moe_tune")
    level, quiet.level = quiet.level, logging.ERROR  # its warnings (records cut) come again, logged, in the run
    try:
        build_datasets(data, build_tokenizer(cfg.model.path), cfg.train.seq_len, cfg.train.seed)
    finally:
        quiet.setLevel(level)
