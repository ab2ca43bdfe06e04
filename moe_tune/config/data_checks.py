"""Checks of the data settings (part of ``validate``)."""

from __future__ import annotations

import os

from moe_tune.config.schema import Config, ConfigError


def check_data(cfg: Config) -> None:
    """The data and evaluation settings' values, each refused with one line naming the fix."""
    d = cfg.data
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction ({d.val_fraction}) must be in [0, 1); try data.val_fraction=0.01")
    if d.val_fraction > 0 and d.val_path is not None:
        raise ConfigError(
            f"data.val_path ({d.val_path}) and data.val_fraction ({d.val_fraction}) both set; keep one of them"
        )
    if d.packing_buffer < 1:
        raise ConfigError(f"data.packing_buffer ({d.packing_buffer}) must be >= 1 (open rows while streaming); try 64")
    if d.num_proc < 1:
        raise ConfigError(f"data.num_proc ({d.num_proc}) must be >= 1; try data.num_proc=1")
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every ({cfg.train.eval_every}) must be >= 0 (0: at the end only)")
    if d.chat_template is not None and not os.path.isfile(d.chat_template):
        raise ConfigError(f"data.chat_template={d.chat_template!r} is not a file; give a Jinja chat template file")
