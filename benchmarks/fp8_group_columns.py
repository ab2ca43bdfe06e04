"""The column quantizations of ``kernels.experts=grouped_mm_fp8`` on one GPU, each way of computing them: per group
(one program per group and block of columns), by row tiles (two kernels over tiles of rows) and, for the input
gradient's experts, by transpose (a tiled bf16 transpose, then the row kernel): ``fp8_grouped.COLUMNS_BY_ROW_TILES``
for the weight gradient's operands, ``fp8_grouped.EXPERT_COLUMNS`` for the experts, at
Qwen3-30B-A3B's shapes: the weight gradient's operands (rows = 4096 tokens x micro-batch x top-8, in 128 groups of
skewed counts, padded to 16; columns 2048, 768 and 1536) and the input gradient's experts ([128, 1536, 2048] and
[128, 2048, 768]). Each way's outputs are compared bit for bit with the first's. Median of 30 calls after 5, CUDA
events; GB/s counts two reads of the input and one write of the E4M3 values.

    python benchmarks/fp8_group_columns.py OUT_DIR [MICRO_BATCH ...]   (default 1 3)
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
from fp8_experts_h200 import E, counts_for
from fp8_experts_h200 import _median_ms as median_ms

from moe_tune.kernels import fp8_grouped

D, I = 2048, 768  # noqa: E741 (I: expert hidden dim, the moe/ legend)


def _cases(micro_batch: int) -> list[tuple[str, object, int]]:
    """(name, the call, bytes moved) for each column quantization of one layer's step."""
    g = torch.Generator().manual_seed(0)
    rows = 4096 * micro_batch * 8
    offs = (counts_for("skewed") * micro_batch).cumsum(0).to("cuda", torch.int32)  # 32,768 rows per micro-batch
    cases = []
    for cols in (D, I, 2 * I):
        t = torch.randn(rows, cols, generator=g).to("cuda", torch.bfloat16)
        call = functools.partial(fp8_grouped.quantize_padded_group_columns_triton, t, offs)
        cases.append((f"weight grad operand, {rows} x {cols}", call, 5 * t.numel()))
    for n, k in ((2 * I, D), (D, I)):
        w = torch.randn(E, n, k, generator=g).to("cuda", torch.bfloat16)
        cases.append(
            (
                f"input grad experts, {E} x {n} x {k}",
                lambda w=w: fp8_grouped.quantize_expert_columns_triton(w),
                5 * w.numel(),
            )
        )
    return cases


def _as_bytes(out) -> list[torch.Tensor]:
    """The outputs to compare: the E4M3 values as bytes, a weight-gradient operand's up to its last padded group
    (the columns past it are left unwritten)."""
    if len(out) == 3:
        q, inv, padded = out
        out = (q[:, : int(padded[-1])], inv, padded)
    return [t.view(torch.uint8) if t.dtype == fp8_grouped.E4M3 else t for t in out]


WAYS = ("per_group", "by_row_tiles", "by_transpose")


def main(argv: list[str]) -> int:
    out_dir, mbs = argv[0], [int(m) for m in argv[1:]] or [1, 3]
    rows, saved = [], (fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.EXPERT_COLUMNS)
    for mb in mbs:
        for name, call, moved in _cases(mb):
            result = {"micro_batch": mb, "case": name}
            outs = []
            for way in WAYS:
                if way == "by_transpose" and not name.startswith("input grad"):
                    continue
                fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.EXPERT_COLUMNS = way == "by_row_tiles", way
                outs.append(_as_bytes(call()))
                ms = median_ms(call)
                result[way] = {"ms": ms, "gb_s": moved / ms / 1e6}
            fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.EXPERT_COLUMNS = saved
            result["equal"] = all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))
            rows.append(result)
            times = "  ".join(f"{way} {result[way]['ms']:6.3f} ms" for way in WAYS if way in result)
            print(f"mb {mb} {name:<44} {times}  equal {result['equal']}")
    os.makedirs(out_dir, exist_ok=True)
    device = torch.cuda.get_device_name()
    with open(os.path.join(out_dir, "fp8_group_columns.json"), "w") as f:
        json.dump(
            {"gpu": device, "commit": os.environ.get("MOE_TUNE_COMMIT"), "torch": torch.__version__, "rows": rows},
            f,
            indent=2,
        )
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
