"""What the frozen base's quantized GEMMs (``fp8_frozen``, ``nf4_frozen``) share: a custom op ``op(x, *frozen, triton)``
differentiable in ``x`` only, whose backward is another custom op ``input_grad(dy, *frozen, triton)``; the grouped GEMM
that reads quantized weights tile by tile on CUDA (``quantized_grouped_mm``, ``kernels.quantized_base=triton``) and its
CPU reference (``dense_grouped_mm``)."""

from __future__ import annotations

import functools

import torch

from moe_tune.kernels.groups import group_counts


def register_input_grad(op, input_grad) -> None:
    """Give custom op ``op(x, *frozen, triton) -> y`` the autograd ``dx = input_grad(dy, *frozen, triton)``; no
    gradient reaches the frozen tensors, and only they are saved for backward."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:-1])
        ctx.triton = inputs[-1]

    def backward(ctx, dy):
        frozen = ctx.saved_tensors
        return input_grad(dy.contiguous(), *frozen, ctx.triton), *([None] * (len(frozen) + 1))

    op.register_autograd(backward, setup_context=setup_context)


def dense_grouped_mm(a_RC: torch.Tensor, w_eNK: torch.Tensor, offs_e: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """``a @ W_j^T`` (``transpose``) or ``a @ W_j`` for the rows of each group j, with dense ``[e, N, K]`` weights
    (the dequantized ones): one fp32 matmul per group, rounded to a's dtype; rows past the last group are 0. The CPU's
    path, and the reference the GPU kernel is tested against."""
    e, N, K = w_eNK.shape
    out = a_RC.new_zeros(a_RC.shape[0], N if transpose else K)
    bounds = [0, *offs_e.tolist()]
    for j in range(e):
        rows = slice(bounds[j], bounds[j + 1])
        w = w_eNK[j].float()
        out[rows] = (a_RC[rows].float() @ (w.T if transpose else w)).to(out.dtype)
    return out


# Rows per tile of the Triton kernel: its tile schedule (``tile_ends``) is made for this size before the launch.
BLOCK_M = 128
# (BLOCK_O, BLOCK_C, num_warps, num_stages) tried on the first call of each shape and direction.
CONFIGS = ((128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4))


def tile_ends(offs_e: torch.Tensor, num_rows: int, block_m: int = BLOCK_M) -> torch.Tensor:
    """The running count of ``block_m``-row tiles per group, then one more entry for the rows past the last group
    (e + 1 entries, int32, on the device: no host sync)."""
    ends = torch.cat([offs_e.long(), offs_e.new_full((1,), num_rows).long()])
    counts = group_counts(ends)
    return torch.cumsum((counts + block_m - 1) // block_m, 0).to(torch.int32)


@functools.cache
def _tuned_kernel():
    import triton

    from moe_tune.kernels.triton_frozen import frozen_grouped_mm_kernel

    configs = [triton.Config({"BLOCK_O": o, "BLOCK_C": c}, num_warps=w, num_stages=st) for o, c, w, st in CONFIGS]
    return triton.autotune(configs, key=["N", "K", "FORMAT", "TRANSPOSE"])(frozen_grouped_mm_kernel)


def quantized_grouped_mm(
    a_RC: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    offs_e: torch.Tensor,
    *,
    transpose: bool,
    table: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``a @ W_j^T`` (``transpose``) or ``a @ W_j`` for the rows of each group j, with ``W_j`` ``[N, K]`` read from its
    quantized storage tile by tile (``triton_frozen``): FP8 ``w`` ``[e, N, K]`` with row scales ``s`` ``[e, N]``, or,
    given the NF4 ``table``, codes ``w`` ``[e, N, K / 2]`` with block scales ``s`` ``[e, N, K / block]``. Rows past
    the last group are 0. ``config`` (BLOCK_O, BLOCK_C, num_warps, num_stages) skips the tuning (the interpreter)."""
    import triton

    nf4 = table is not None
    e, N = w.shape[:2]
    K = 2 * w.shape[2] if nf4 else w.shape[2]
    a_RC = a_RC.contiguous()
    R = a_RC.shape[0]
    out = torch.empty(R, N if transpose else K, dtype=a_RC.dtype, device=a_RC.device)
    if R == 0:
        return out
    scales_per_row = s.shape[-1] if nf4 else 1
    args = (
        a_RC,
        w,
        s,
        table if nf4 else s,
        offs_e,
        tile_ends(offs_e, R),
        out,
        R,
        N,
        K,
        e,
        scales_per_row,
    )
    meta = dict(
        FORMAT=int(nf4),
        SCALE_BLOCK=K // scales_per_row if nf4 else 1,
        TRANSPOSE=transpose,
        IEEE=a_RC.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_GROUPS=triton.next_power_of_2(e + 1),
    )
    grid = lambda m: (triton.cdiv(R, BLOCK_M) + e + 1, triton.cdiv(out.shape[1], m["BLOCK_O"]))  # noqa: E731
    if config is None:
        _tuned_kernel()[grid](*args, **meta)
    else:
        from moe_tune.kernels.triton_frozen import frozen_grouped_mm_kernel

        o, c, warps, stages = config
        frozen_grouped_mm_kernel[grid](*args, **meta, BLOCK_O=o, BLOCK_C=c, num_warps=warps, num_stages=stages)
    return out
