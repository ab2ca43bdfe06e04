"""The logger interface and what every tracker shares: the numeric fields of a metrics row, the flat config."""

from __future__ import annotations


class Logger:
    """The interface, and the logger that does nothing (``logger=none``, ranks other than 0)."""

    def log(self, step: int, row: dict) -> None:
        """The numeric fields of ``row`` (``step`` itself excluded) as scalars at ``step``."""

    def log_image(self, step: int, name: str, image) -> None:
        """An HxWx3 uint8 array (or a matplotlib Figure) as image ``name`` at ``step``."""

    def close(self) -> None:
        """Flush and end the run; called once, also when the run stops early."""


def scalars(row: dict) -> dict[str, float]:
    """The numeric fields of a metrics row, ``step`` excluded (booleans and strings are not scalars)."""
    return {
        k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as ``{"train.lr": 0.003, ...}`` (the trackers' flat parameters)."""
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


__all__ = ["Logger", "flatten", "scalars"]
