"""Grouped GEMMs that read the frozen base's quantized experts as they are stored and dequantize each weight tile in
registers (``moe_tune.kernels.frozen.frozen_grouped_mm`` launches it on CUDA). Module-level functions, so that
Triton's interpreter (``TRITON_INTERPRET=1``) resolves them by name; imported only when the kernel is launched (CPU
installs need not have Triton).

Each group j's weight ``W_j`` is ``[N, K]`` (out, in) in one of two formats:
  - FP8 (``FORMAT=0``): E4M3 ``q[j, n, k]`` with one scale ``s[j, n]`` per output row: ``W = q * s``, exact in bf16
    (three mantissa bits times a power of two).
  - NF4 (``FORMAT=1``): codes ``[j, n, k // 2]`` (two per byte, the lower nibble first) with one scale per block of
    ``SCALE_BLOCK`` inputs ``[j, n, k // SCALE_BLOCK]``: ``W = table[code] * scale``, the product in fp32 then rounded to the
    input's dtype, as ``nf4_frozen.dequantize_weight`` rounds it.
``TRANSPOSE``: ``out = a @ W_j^T`` (forward: a ``[R, K]``, out ``[R, N]``); otherwise ``out = a @ W_j`` (the input
gradient: a ``[R, N]``, out ``[R, K]``). Either way the weight tile is read from the same ``[N, K]`` storage, so the
backward needs no transposed copy of the experts, and no step holds a dequantized expert beyond one tile.

Scheduling: group j's rows ``[offs[j-1], offs[j])`` are cut into tiles of ``BLOCK_M`` rows; ``tile_ends`` (e + 1
entries, made on the device: no host sync) is the running count of tiles per group, the last entry counting the
rows past ``offs[e-1]`` (a dispatcher's padding), whose output is written as zeros. Program (m, o) finds its group by
counting the ``tile_ends`` at or below m; programs past the last tile return at once (the grid is the host's upper
bound ``ceil(R / BLOCK_M) + e + 1``).
"""

import triton
import triton.language as tl


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    table_ptr,
    group,
    n,
    k0,
    N,
    K,
    scales_per_row,
    FORMAT: tl.constexpr,
    KT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    dtype,
):
    """``W_group[n, k0 : k0 + KT]`` for the row indices ``n`` as a ``[len(n), KT]`` tile in ``dtype``; entries out of
    range are 0. NF4: each byte read once, its two codes looked up and interleaved; one scale per ``SCALE_BLOCK``
    columns (KT a multiple of it) broadcast over its block."""
    group = group.to(tl.int64)
    n_ok = n < N
    if FORMAT == 0:
        k = k0 + tl.arange(0, KT)
        mask = n_ok[:, None] & (k[None, :] < K)
        q = tl.load(w_ptr + group * N * K + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + group * N + n, mask=n_ok, other=0.0)
        return (q * s[:, None]).to(dtype)
    else:  # (not code after the return: Triton compiles that for FP8 too, and its integer fill cannot become FP8)
        half = k0 // 2 + tl.arange(0, KT // 2)
        mask = n_ok[:, None] & (half[None, :] < K // 2)
        byte = tl.load(w_ptr + group * N * (K // 2) + n[:, None] * (K // 2) + half[None, :], mask=mask, other=0)
        byte = byte.to(tl.int32)
        low = tl.load(table_ptr + (byte & 0xF))
        high = tl.load(table_ptr + (byte >> 4))
        value = tl.reshape(tl.join(low, high), (n.shape[0], KT))  # the lower nibble first
        blocks = k0 // SCALE_BLOCK + tl.arange(0, KT // SCALE_BLOCK)
        scale_mask = n_ok[:, None] & (blocks[None, :] < scales_per_row)
        scale_at = group * N * scales_per_row + n[:, None] * scales_per_row + blocks[None, :]
        scale = tl.load(s_ptr + scale_at, mask=scale_mask, other=0.0).to(tl.float32)
        value = tl.reshape(value, (n.shape[0], KT // SCALE_BLOCK, SCALE_BLOCK)) * scale[:, :, None]
        return tl.reshape(value, (n.shape[0], KT)).to(dtype)


@triton.jit
def frozen_grouped_mm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    table_ptr,
    offs_ptr,
    tile_ends_ptr,
    out_ptr,
    R,
    N,
    K,
    num_groups,
    scales_per_row,
    FORMAT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """``out[rows of j] = a[rows of j] @ W_j^T`` (``TRANSPOSE``) or ``@ W_j``; see the module's docstring."""
    pid_m = tl.program_id(0)
    pid_o = tl.program_id(1)
    group, rows, row_end = _tile_rows(tile_ends_ptr, offs_ptr, pid_m, R, num_groups, BLOCK_M, BLOCK_GROUPS)
    if group > num_groups:  # past the last tile
        return
    O = N if TRANSPOSE else K  # noqa: E741 (the output's width)
    cols = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    if group < num_groups:  # (the rows past the last group keep acc's zeros)
        weights = (w_ptr, s_ptr, table_ptr, group, N, K, scales_per_row)
        acc = _contract(a_ptr, weights, rows, row_end, cols, pid_o * BLOCK_O, acc, FORMAT, SCALE_BLOCK, TRANSPOSE, IEEE,
                        BLOCK_O, BLOCK_C)  # fmt: skip
    mask = (rows[:, None] < row_end) & (cols[None, :] < O)
    tl.store(out_ptr + rows[:, None] * O + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_rows(tile_ends_ptr, offs_ptr, pid_m, R, num_groups, BLOCK_M: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """(the group of tile ``pid_m``, its row indices, the group's end row); the group is ``num_groups`` for the rows
    past the last group and larger past the last tile."""
    groups = tl.arange(0, BLOCK_GROUPS)
    tile_ends = tl.load(tile_ends_ptr + groups, mask=groups <= num_groups, other=2**31 - 1)
    group = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)
    tile_start = tl.load(tile_ends_ptr + group - 1, mask=group > 0, other=0)
    row_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    row_end = tl.load(offs_ptr + group, mask=group < num_groups, other=R).to(tl.int64)
    rows = row_start + (pid_m - tile_start).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    return group, rows, row_end


@triton.jit
def _contract(a_ptr, weights, rows, row_end, cols, o0, acc, FORMAT: tl.constexpr, SCALE_BLOCK: tl.constexpr,
              TRANSPOSE: tl.constexpr, IEEE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """``acc`` plus the tile's rows of ``a`` times the weight tiles over the whole contraction."""
    w_ptr, s_ptr, table_ptr, group, N, K, scales_per_row = weights
    C = K if TRANSPOSE else N  # the contraction
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        a_mask = (rows[:, None] < row_end) & (c[None, :] < C)
        a = tl.load(a_ptr + rows[:, None] * C + c[None, :], mask=a_mask, other=0.0)
        if TRANSPOSE:  # W's rows are the output columns, its columns the contraction
            w = _weight_tile(w_ptr, s_ptr, table_ptr, group, cols, c0, N, K, scales_per_row, FORMAT, BLOCK_C,
                             SCALE_BLOCK, a.dtype)  # fmt: skip
            w = tl.trans(w)
        else:  # W's rows are the contraction, its columns the output columns
            w = _weight_tile(w_ptr, s_ptr, table_ptr, group, c, o0, N, K, scales_per_row, FORMAT, BLOCK_O,
                             SCALE_BLOCK, a.dtype)  # fmt: skip
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc
