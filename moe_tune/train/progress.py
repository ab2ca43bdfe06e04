"""Rank 0's view of the run: a tqdm bar on a terminal, else one log line per metrics row."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("moe_tune")


class Progress:
    def __init__(self, rank: int, total: int, initial: int):
        self.rank = rank
        self.bar = None
        if rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def report(self, row: dict) -> None:
        text = f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s"
        if row.get("row_fill", 1.0) < 1.0:  # tok/s counts real tokens: say how much of the rows they fill
            text += f" ({100 * row['row_fill']:.1f}% of row positions)"
        if row["peak_mem_gib"] > 0:  # 0 without a GPU: nothing measured, so nothing shown
            text += f" | {row['peak_mem_gib']:.1f} GiB"
        if "val_loss" in row:
            text += f" | val_loss {row['val_loss']:.4f} | val_ppl {row['val_ppl']:.2f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(row["step"] - self.bar.n)
        elif self.rank == 0:
            log.info("step %d | %s | grad_norm %.3f | lr %.2e", row["step"], text, row["grad_norm"], row["lr"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


__all__ = ["Progress"]
