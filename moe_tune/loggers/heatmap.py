"""Expert load as an image: MoE layers down (labelled by decoder layer), experts across, each layer's counts over
its mean (1 = even load). matplotlib (an optional dependency; ``require_logger`` checks it) draws off-screen,
without pyplot."""

from __future__ import annotations

import numpy as np


def normalised_load(counts_LE: np.ndarray) -> np.ndarray:
    """Each layer's rows per expert over the layer's mean: 1 everywhere is a perfectly balanced layer."""
    counts_LE = np.asarray(counts_LE, dtype=np.float64)
    return counts_LE / np.maximum(counts_LE.mean(axis=1, keepdims=True), 1e-12)


def figure_to_array(figure) -> np.ndarray:
    """A matplotlib Figure rendered to an HxWx3 uint8 array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def layer_ticks(layer_ids: list[int], most: int = 16) -> tuple[list[int], list[str]]:
    """Row positions and labels for the heat map's layer axis: the decoder layer index of each row (at most
    ``most`` of them, evenly spaced), so a model with dense leading layers is not shown from 0."""
    stride = -(-len(layer_ids) // most) or 1
    rows = list(range(0, len(layer_ids), stride))
    return rows, [str(layer_ids[r]) for r in rows]


def expert_load_image(counts_LE: np.ndarray, step: int, layer_ids: list[int] | None = None) -> np.ndarray:
    """The heat map of ``counts_LE`` (MoE layers x experts, rows routed to each expert) as an HxWx3 uint8 array;
    ``layer_ids``: each row's decoder layer index (default 0, 1, ...)."""
    from matplotlib.figure import Figure

    load_LE = normalised_load(counts_LE)
    L, E = load_LE.shape
    fig = Figure(figsize=(min(2 + 0.25 * E, 16), min(1.5 + 0.3 * L, 12)), dpi=80)
    ax = fig.add_subplot()
    im = ax.imshow(load_LE, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_yticks(*layer_ticks(list(range(L)) if layer_ids is None else list(layer_ids)))
    ax.set_ylabel("decoder layer (MoE layers)")
    ax.set_title(f"expert load / mean, step {step}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return figure_to_array(fig)


def log_expert_load(logger, step: int, moe_stats) -> None:
    """``moe_stats``' rows per expert (a ``MoEStats``) drawn and given to ``logger`` at ``step``. A host sync: the
    trainer calls it on image steps only, which are sync steps (the device is idle)."""
    image = expert_load_image(moe_stats.counts_LE().cpu().numpy(), step, list(moe_stats.layer_idx))
    logger.log_image(step, "expert_load", image)


__all__ = ["expert_load_image", "figure_to_array", "layer_ticks", "log_expert_load", "normalised_load"]
