"""Row-wise E4M3 quantization in one pass (``moe_tune.kernels.fp8_grouped.quantize_rows_triton`` launches it on
CUDA) and a tiled transpose of stacked FP8 experts (``fp8_frozen.transpose_experts``). Module-level functions, so
that Triton's interpreter (``TRITON_INTERPRET=1``) resolves them by name; imported only when a kernel is launched
(CPU installs need not have Triton)."""

import triton
import triton.language as tl


@triton.jit
def _pow2_scale(amax):
    """The largest power of two that maps ``amax`` to at most 448 (E4M3's largest), read off its bits as
    ``fp8_grouped._pow2_scale`` does with frexp: bitwise the same result. amax = 1.m x 2^(biased - 127) and
    448 = 1.75 x 2^8, so the power is 8 - (biased - 127), one less when 1.m > 1.75; an amax of 0 takes 1e-30's."""
    bits = tl.maximum(amax, 1e-30).to(tl.int32, bitcast=True)
    power = 135 - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return ((power + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    q_ptr,
    inv_scale_ptr,
    col_scale_ptr,
    offs_ptr,
    num_groups,
    K,
    x_row_stride,
    HAS_COL_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """One program per row of ``x`` [R, K]: optionally multiplied by the row's group's column scales
    (``col_scale[g, :]``, g the row's group: how many of the ``num_groups`` group ends ``offs`` are at or before
    the row, so rows past the last group read row ``num_groups``, a row of zeros), then scaled by ``_pow2_scale`` of
    the row's largest magnitude and rounded to E4M3 into ``q`` [R, K]; ``inv_scale[row]`` holds what to multiply the
    E4M3 values by. Unfused, PyTorch ran about eight passes over the row block (abs, amax, scale, clamp, cast)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL_SCALE:
        groups = tl.arange(0, BLOCK_GROUPS)
        ends = tl.load(offs_ptr + groups, mask=groups < num_groups, other=2**31 - 1).to(tl.int64)
        group = tl.sum((ends <= row).to(tl.int64), axis=0)
        x = x * tl.load(col_scale_ptr + group * K + cols, mask=mask, other=0.0)
    scale = _pow2_scale(tl.max(tl.abs(x), axis=0))
    q = tl.minimum(tl.maximum(x * scale, -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_scale_ptr + row, 1.0 / scale)


@triton.jit
def transpose_kernel(x_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[j] = x[j]^T`` for each of the stacked matrices ``x`` [e, N, K] into ``out`` [e, K, N], both contiguous:
    program (n, k, j) reads a [BLOCK_N, BLOCK_K] tile along K (coalesced) and writes it transposed along N
    (coalesced), the exchange in registers and shared memory. A strided element-wise copy reads one byte per
    32-byte sector for 1-byte values."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    base = tl.program_id(2).to(tl.int64) * N * K
    mask = (n[:, None] < N) & (k[None, :] < K)
    tile = tl.load(x_ptr + base + n[:, None] * K + k[None, :], mask=mask, other=0)
    tl.store(out_ptr + base + k[:, None] * N + n[None, :], tl.trans(tile), mask=tl.trans(mask))


@triton.jit
def quantize_group_columns_kernel(
    t_ptr,
    q_ptr,
    inv_scale_ptr,
    offs_ptr,
    out_offs_ptr,
    C,
    t_row_stride,
    out_group_scale,
    out_col_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (group g, block of columns) of ``t`` [R, C], whose rows come in groups (group g: rows
    ``offs[g-1]`` to ``offs[g]``): one power-of-two scale per (group, column) over the group's rows
    (``_pow2_scale``), ``inv_scale[g, c]`` its inverse; the E4M3 values written transposed, column c
    of group g at ``q + out_offs[g-1] x out_group_scale + c x out_col_stride``, one element per row, and zeros
    after the group's rows up to ``out_offs[g]`` (its padding). Two reads of the group's rows (amax, then the values),
    one write, nothing read on the host. The FP8 weight gradient's operands (``out_offs`` the groups padded to 16
    rows, ``out_group_scale`` 1, ``out_col_stride`` the padded row count: a [C, P] matrix) and the input gradient's
    experts (groups of N rows of the stored ``[e, N, K]`` experts, ``out_group_scale`` K, ``out_col_stride`` N:
    ``[e, K, N]``)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    first = g > 0
    start = tl.load(offs_ptr + g - 1, mask=first, other=0).to(tl.int64)
    end = tl.load(offs_ptr + g).to(tl.int64)
    out_start = tl.load(out_offs_ptr + g - 1, mask=first, other=0).to(tl.int64)
    out_rows = tl.load(out_offs_ptr + g).to(tl.int64) - out_start
    rows = tl.arange(0, BLOCK_R)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        mask = ((r0 + rows) < end)[:, None] & col_mask[None, :]
        x = tl.load(t_ptr + (r0 + rows)[:, None] * t_row_stride + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    scale = _pow2_scale(amax)
    tl.store(inv_scale_ptr + g.to(tl.int64) * C + cols, 1.0 / scale, mask=col_mask)
    out_base = q_ptr + out_start * out_group_scale + cols[:, None].to(tl.int64) * out_col_stride
    for i0 in range(0, out_rows, BLOCK_R):
        i = i0 + rows
        mask = ((start + i) < end)[:, None] & col_mask[None, :]
        x = tl.load(t_ptr + (start + i)[:, None] * t_row_stride + cols[None, :], mask=mask, other=0.0)
        q = tl.minimum(tl.maximum(x.to(tl.float32) * scale[None, :], -448.0), 448.0)
        out_mask = col_mask[:, None] & (i < out_rows)[None, :]
        tl.store(out_base + i[None, :], tl.trans(q).to(q_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _group_tile(tile, offs_ptr, out_offs_ptr, num_groups, BLOCK_R: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Output tile number ``tile`` when each group's output rows (``out_offs[g-1]`` to ``out_offs[g]``) are cut into
    tiles of BLOCK_R rows, group after group (a group's last tile may be short, an empty group has none): (its
    group, num_groups past the last tile; the tile's first output row as an offset into the group; the group's
    first output row, first source row (``offs``) and end of source rows)."""
    groups = tl.arange(0, BLOCK_GROUPS)
    valid = groups < num_groups
    ends = tl.load(out_offs_ptr + groups, mask=valid, other=0)
    starts = tl.load(out_offs_ptr + groups - 1, mask=valid & (groups > 0), other=0)
    tiles = tl.where(valid, (ends - starts + BLOCK_R - 1) // BLOCK_R, 0)
    cum = tl.cumsum(tiles, axis=0)
    group = tl.sum((cum <= tile).to(tl.int32), axis=0)
    here = groups == group
    first = (tile - tl.sum(tl.where(here, cum - tiles, 0), axis=0)) * BLOCK_R
    out_start = tl.sum(tl.where(here, starts, 0), axis=0).to(tl.int64)
    out_rows = tl.sum(tl.where(here, ends - starts, 0), axis=0)
    start = tl.load(offs_ptr + group - 1, mask=(group > 0) & (group < num_groups), other=0).to(tl.int64)
    end = tl.load(offs_ptr + group, mask=group < num_groups, other=0).to(tl.int64)
    return group, first, out_rows, out_start, start, end


@triton.jit
def _load_group_tile(
    t_ptr,
    offs_ptr,
    out_offs_ptr,
    num_groups,
    C,
    t_row_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Program (tile, block of columns)'s part of ``t``, as fp32 (zeros for padding rows and past the group's
    tiles), with (group, the tile's output rows as offsets into the group, the group's output row count and first
    output row, the columns, their mask)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    group, first, out_rows, out_start, start, end = _group_tile(
        tl.program_id(0), offs_ptr, out_offs_ptr, num_groups, BLOCK_R, BLOCK_GROUPS
    )
    i = first + tl.arange(0, BLOCK_R)
    src = start + i
    mask = (src < end)[:, None] & col_mask[None, :]  # end is 0 past the last group: nothing read
    x = tl.load(t_ptr + src[:, None] * t_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, group, i, out_rows, out_start, cols, col_mask


@triton.jit
def group_column_amax_kernel(
    t_ptr,
    amax_ptr,
    offs_ptr,
    out_offs_ptr,
    num_groups,
    C,
    t_row_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """``quantize_group_columns_kernel``'s first pass spread over tiles: program (tile, block of columns) takes the
    source rows of one output tile of one group (``_group_tile``) and folds their column maxima of |t| into
    ``amax[g]`` (``amax`` [G, C], zeros before) by atomic max. Padding rows read as zeros."""
    x, group, _, _, _, cols, col_mask = _load_group_tile(
        t_ptr, offs_ptr, out_offs_ptr, num_groups, C, t_row_stride, BLOCK_R, BLOCK_C, BLOCK_GROUPS
    )
    if group < num_groups:
        tl.atomic_max(amax_ptr + group.to(tl.int64) * C + cols, tl.max(tl.abs(x), axis=0), mask=col_mask)


@triton.jit
def quantize_group_columns_by_rows_kernel(
    t_ptr,
    q_ptr,
    amax_ptr,
    inv_scale_ptr,
    offs_ptr,
    out_offs_ptr,
    num_groups,
    C,
    t_row_stride,
    out_group_scale,
    out_col_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """``quantize_group_columns_kernel``'s second pass over the same tiles, after ``group_column_amax_kernel``:
    the tile's source rows scaled by their group's column scales, zeros for its padding rows, written transposed
    where ``quantize_group_columns_kernel`` writes them (column c of group g's output row i at ``q + out_offs[g-1]
    x out_group_scale + c x out_col_stride + i``). The programs of tile 0 also write the inverse scales [G, C]."""
    x, group, i, out_rows, out_start, cols, col_mask = _load_group_tile(
        t_ptr, offs_ptr, out_offs_ptr, num_groups, C, t_row_stride, BLOCK_R, BLOCK_C, BLOCK_GROUPS
    )
    if group < num_groups:
        scale = _pow2_scale(tl.load(amax_ptr + group.to(tl.int64) * C + cols, mask=col_mask, other=0.0))
        q = tl.minimum(tl.maximum(x * scale[None, :], -448.0), 448.0)
        base = q_ptr + out_start * out_group_scale + cols[:, None].to(tl.int64) * out_col_stride
        out_mask = col_mask[:, None] & (i < out_rows)[None, :]
        tl.store(base + i[None, :], tl.trans(q).to(q_ptr.dtype.element_ty), mask=out_mask)
    if tl.program_id(0) == 0:
        for g0 in range(0, num_groups, BLOCK_R):
            g = g0 + tl.arange(0, BLOCK_R)
            gmask = (g < num_groups)[:, None] & col_mask[None, :]
            a = tl.load(amax_ptr + g[:, None].to(tl.int64) * C + cols[None, :], mask=gmask, other=0.0)
            tl.store(inv_scale_ptr + g[:, None].to(tl.int64) * C + cols[None, :], 1.0 / _pow2_scale(a), mask=gmask)
