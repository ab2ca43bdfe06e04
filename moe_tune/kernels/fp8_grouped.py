"""The routed experts' grouped GEMMs in FP8 (E4M3) with row-wise scales: ``kernels.experts=grouped_mm_fp8``.

``fp8_grouped_mm(x_RK, w_eKN, offs_e)`` is a drop-in for ``experts.grouped_mm``: each of its three GEMMs
(forward, input gradient, weight gradient) quantizes both operands to E4M3 on the fly and runs
``torch._scaled_grouped_mm`` (a CUTLASS kernel for Hopper, sm90). Every scale is a power of two, so scaling and
unscaling add no rounding of their own, and every scale is computed on the device: no host sync. On CUDA each
operand is quantized by one Triton kernel: rows stored contiguously by ``quantize_rows_triton`` (x, dy, the forward's
experts), the input gradient's experts over their other axis by ``quantize_expert_columns_triton``, the weight
gradient's padded groups by ``quantize_padded_group_columns_triton``. The three GEMMs are custom ops with their
autograd registered, so that ``torch.compile`` calls them as they are (nothing inside them fuses).

The kernel's contract (the same checks as its meta function, which the CPU emulation runs): the left operand
row-major, the right one column-major, fp32 scales holding what to multiply the FP8 values by, row counts and
contraction dims whose FP8 rows are 16-byte aligned (K and N multiples of 16), bf16 output.

Legend (the moe/ one): R routed rows, K and N a GEMM's in and out dims, e local experts (groups), P rows after
padding each group to a multiple of 16, B = P / 16 blocks of 16 rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_tune.kernels.groups import ROW_ALIGN, pad_groups, padded_counts, padded_row_bound

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# The column quantizations' kernels; every choice gives the same values (benchmarks/fp8_group_columns.py times them
# on a GPU and checks them equal). COLUMNS_BY_ROW_TILES, the weight gradient's operands: True, two kernels over tiles
# of one group's rows (ROW_TILE: rows, columns); False, one program per (group, block of columns) walking the
# group's rows twice, where a hot expert's program holds the tail (slower at Qwen3-30B-A3B's shapes).
# EXPERT_COLUMNS, the input gradient's experts: "per_group" or "by_row_tiles" (those kernels over groups of N rows),
# or "by_transpose" (a tiled bf16 transpose, then the row kernel).
COLUMNS_BY_ROW_TILES = True
EXPERT_COLUMNS = "per_group"
ROW_TILE = (64, 64)

# (a, b, scale_a, scale_b, offs, fast_accum) -> bf16 out: the real kernel or its emulation.
ScaledGroupedMM = Callable[..., torch.Tensor]


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The largest power of two that maps ``amax`` to at most E4M3's largest value (448 = 0.875 x 2^9), read off
    ``amax``'s own exponent and mantissa: exact, where ``448 / amax`` would round. All-zero rows (empty groups,
    padding) get a finite scale: their values are zero whatever it is. ``moe_tune.kernels.triton_fp8`` computes
    the same from the float's bits."""
    mantissa, exponent = torch.frexp(amax.float().clamp(min=1e-30))  # amax = mantissa x 2^exponent, [0.5, 1)
    power = 9 - exponent - (mantissa > 0.875).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(mantissa), power)


def _to_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(t_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row over the last dim (batched over leading dims). Returns the E4M3 values, contiguous, and
    the dequantization scales ``[..., R]`` (what the kernel multiplies by)."""
    scale = _pow2_scale(t_RC.abs().amax(dim=-1, keepdim=True))
    return _to_e4m3(t_RC, scale).contiguous(), scale.reciprocal().squeeze(-1)


def quantize_group_columns(t_PC: torch.Tensor, group_B: torch.Tensor, num_groups: int):
    """One scale per (group, column): rows come in blocks of 16 that each belong to one group (``group_B``, a
    block's group; ``num_groups`` counts a last group of padding). Returns the E4M3 values and the
    dequantization scales ``[num_groups, C]``."""
    P, C = t_PC.shape
    blocks_BLC = t_PC.view(P // ROW_ALIGN, ROW_ALIGN, C)
    amax_BC = blocks_BLC.abs().amax(dim=1).float()
    index_BC = group_B.unsqueeze(1).expand(-1, C)
    amax_GC = amax_BC.new_zeros(num_groups, C).scatter_reduce_(0, index_BC, amax_BC, "amax")
    scale_GC = _pow2_scale(amax_GC)
    q_PC = _to_e4m3(blocks_BLC, scale_GC[group_B].unsqueeze(1)).view(P, C)
    return q_PC, scale_GC.reciprocal()


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum: bool) -> torch.Tensor:
    """The CUDA kernel."""
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum: bool) -> torch.Tensor:
    """What the kernel computes, in fp32 from the dequantized operands, group by group (tests; CPU). First runs
    the kernel's meta function, so operands the kernel would refuse (layout, dtypes, scale shapes) fail here too."""

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    torch._scaled_grouped_mm(
        *map(meta, (a, b, scale_a, scale_b)), offs=meta(offs), out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )
    bounds = [0, *offs.tolist()]  # host sync: the emulation loops over the groups in Python
    groups = list(zip(bounds[:-1], bounds[1:]))
    if b.dim() == 3:  # 2d x 3d: a row-scaled, b scaled per (group, column); rows past the last group stay 0
        a32, b32 = a.float() * scale_a[:, None], b.float() * scale_b[:, None, :]
        out = a32.new_zeros(a.shape[0], b.shape[2])
        for j, (s, t) in enumerate(groups):
            out[s:t] = a32[s:t] @ b32[j]
    else:  # 2d x 2d, grouped along the contraction dim: a scaled per (group, row), b per (group, column)
        sa, sb = scale_a.view(len(groups), -1), scale_b.view(len(groups), -1)
        out = torch.stack(
            [(a[:, s:t].float() * sa[j, :, None]) @ (b[s:t].float() * sb[j]) for j, (s, t) in enumerate(groups)]
        )
    return out.to(torch.bfloat16)


def _kernel(emulate: bool) -> ScaledGroupedMM:
    # Looked up at each call: tests wrap the emulation to see which GEMMs run.
    return emulated_scaled_grouped_mm if emulate else scaled_grouped_mm


def quantize_rows_triton(
    x_RK: torch.Tensor, col_scale_GK: torch.Tensor | None = None, offs_e: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of a 2-d ``x`` in one Triton pass (``triton_fp8.quantize_rows_kernel``), bit for bit the
    same values; with ``col_scale_GK`` and ``offs_e``, each row first multiplied by its group's row of column scales
    (``fp8_frozen.quantize_activation_rows``). Unfused, PyTorch runs about eight passes over the rows."""
    import triton

    from moe_tune.kernels.triton_fp8 import quantize_rows_kernel

    x_RK = x_RK if x_RK.stride(-1) == 1 else x_RK.contiguous()
    R, K = x_RK.shape
    q = torch.empty(R, K, dtype=E4M3, device=x_RK.device)
    inv_scale = torch.empty(R, dtype=torch.float32, device=x_RK.device)
    if R:
        block = triton.next_power_of_2(K)
        has_col_scale = col_scale_GK is not None
        num_groups = offs_e.shape[0] if has_col_scale else 1
        quantize_rows_kernel[(R,)](
            x_RK,
            q,
            inv_scale,
            col_scale_GK if has_col_scale else inv_scale,
            offs_e if has_col_scale else inv_scale,
            num_groups,
            K,
            x_RK.stride(0),
            HAS_COL_SCALE=has_col_scale,
            BLOCK=block,
            BLOCK_GROUPS=triton.next_power_of_2(num_groups),
            num_warps=4 if block <= 2048 else 8,
        )
    return q, inv_scale


def quantize_rows_fused(t: torch.Tensor, triton_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` (batched over leading dims), the same values bit for bit. ``triton_kernel`` (None: on CUDA):
    rows laid out contiguously go through ``quantize_rows_triton``, the rows of stacked matrices stored transposed
    (an input gradient's experts) through ``quantize_expert_columns_triton``; other layouts, and the CPU, through
    PyTorch."""
    if not (t.is_cuda if triton_kernel is None else triton_kernel):
        return quantize_rows(t)
    if t.dim() == 3 and not t.is_contiguous() and t.transpose(-2, -1).is_contiguous():
        return quantize_expert_columns_triton(t.transpose(-2, -1))
    if not t.is_contiguous():
        return quantize_rows(t)
    q, inv_scale = quantize_rows_triton(t.view(-1, t.shape[-1]))
    return q.view(t.shape), inv_scale.view(t.shape[:-1])


def _group_columns_triton(
    t_RC, offs_G, out_offs_G, q, out_group_scale: int, out_col_stride: int, by_row_tiles: bool | None = None
) -> torch.Tensor:
    """Launches ``triton_fp8.quantize_group_columns_kernel`` over the groups ``offs_G`` of ``t_RC``'s rows, writing
    the E4M3 values into ``q`` as it places them; returns the inverse scales ``[G, C]``. With
    ``by_row_tiles`` (None: ``COLUMNS_BY_ROW_TILES``) the same values from its two passes spread over tiles of rows."""
    import triton

    from moe_tune.kernels.triton_fp8 import quantize_group_columns_kernel

    t_RC = t_RC if t_RC.stride(-1) == 1 else t_RC.contiguous()
    G, C = offs_G.shape[0], t_RC.shape[1]
    inv_scale_GC = torch.empty(G, C, dtype=torch.float32, device=t_RC.device)
    if G and C and (COLUMNS_BY_ROW_TILES if by_row_tiles is None else by_row_tiles):
        _group_columns_by_row_tiles(t_RC, offs_G, out_offs_G, q, inv_scale_GC, out_group_scale, out_col_stride)
    elif G and C:
        block_c = 64
        quantize_group_columns_kernel[(G, triton.cdiv(C, block_c))](
            t_RC,
            q,
            inv_scale_GC,
            offs_G,
            out_offs_G,
            C,
            t_RC.stride(0),
            out_group_scale,
            out_col_stride,
            BLOCK_R=64,
            BLOCK_C=block_c,
        )
    return inv_scale_GC


def _group_columns_by_row_tiles(t_RC, offs_G, out_offs_G, q, inv_scale_GC, out_group_scale, out_col_stride) -> None:
    """``_group_columns_triton``'s values from ``triton_fp8.group_column_amax_kernel`` and
    ``quantize_group_columns_by_rows_kernel``, each program one tile of ROW_TILE output rows of one group: a long
    group is many programs' work, where one program per group walks all of its rows."""
    import triton

    from moe_tune.kernels.triton_fp8 import group_column_amax_kernel, quantize_group_columns_by_rows_kernel

    G, C = inv_scale_GC.shape
    block_r, block_c = ROW_TILE
    # Tiles per group are ceil(rows / block_r): at most every output row's tile plus one short tile per group.
    grid = (triton.cdiv(q.numel() // C, block_r) + G, triton.cdiv(C, block_c))
    tiles = dict(BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_GROUPS=triton.next_power_of_2(G))
    amax_GC = torch.zeros(G, C, dtype=torch.float32, device=t_RC.device)
    group_column_amax_kernel[grid](t_RC, amax_GC, offs_G, out_offs_G, G, C, t_RC.stride(0), **tiles)
    quantize_group_columns_by_rows_kernel[grid](
        t_RC,
        q,
        amax_GC,
        inv_scale_GC,
        offs_G,
        out_offs_G,
        G,
        C,
        t_RC.stride(0),
        out_group_scale,
        out_col_stride,
        **tiles,
    )


def quantize_padded_group_columns_triton(
    t_RC: torch.Tensor, offs_e: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight gradient's operand in one Triton kernel: ``quantize_group_columns`` of ``t_RC``'s rows padded
    per group to multiples of 16 (``pad_groups``), returned transposed: the E4M3 values ``[C, P]`` (row-major), the
    inverse scales ``[e, C]`` and the padded offsets (int32). The same values as the PyTorch path, which runs about
    ten passes (the padded copy, block amaxes, a scatter, the cast, the transposed copy) where this reads the rows
    twice. Columns past the last padded group are left unwritten: the kernel reads up to the offsets only."""
    P = padded_row_bound(t_RC.shape[0], offs_e.shape[0])
    padded_offs_e = padded_counts(offs_e)[2].to(torch.int32)
    q_CP = torch.empty(t_RC.shape[1], P, dtype=E4M3, device=t_RC.device)
    inv_scale_eC = _group_columns_triton(t_RC, offs_e, padded_offs_e, q_CP, 1, P)
    return q_CP, inv_scale_eC, padded_offs_e


def quantize_expert_columns_triton(w_eNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(w_eNK.transpose(-2, -1))`` of contiguous experts ``[e, N, K]``: one scale per (expert, k) over
    N, the E4M3 values written ``[e, K, N]`` contiguous (the input gradient's right operand), the inverse scales
    ``[e, K]``, the kernels ``EXPERT_COLUMNS`` names. PyTorch reads the strided rows in about eight passes."""
    e, N, K = w_eNK.shape
    if EXPERT_COLUMNS == "by_transpose":
        q_RN, inv_scale_R = quantize_rows_triton(transpose_experts(w_eNK, True).view(e * K, N))
        return q_RN.view(e, K, N), inv_scale_R.view(e, K)
    bounds_e = torch.arange(1, e + 1, device=w_eNK.device, dtype=torch.int32) * N
    q_eKN = torch.empty(e, K, N, dtype=E4M3, device=w_eNK.device)
    tiles = EXPERT_COLUMNS == "by_row_tiles"
    return q_eKN, _group_columns_triton(w_eNK.reshape(e * N, K), bounds_e, bounds_e, q_eKN, K, N, tiles)


def transpose_experts(w_eNK: torch.Tensor, triton_kernel: bool | None = None) -> torch.Tensor:
    """The stacked experts ``[e, N, K]`` transposed into a contiguous ``[e, K, N]`` (the same bytes, moved).
    ``triton_kernel`` (None: on CUDA): one tiled Triton pass; otherwise PyTorch's strided copy."""
    if not (w_eNK.is_cuda if triton_kernel is None else triton_kernel):
        return w_eNK.transpose(-2, -1).contiguous()
    import triton

    from moe_tune.kernels.triton_fp8 import transpose_kernel

    e, N, K = w_eNK.shape
    src = w_eNK.contiguous()
    out = torch.empty(e, K, N, dtype=w_eNK.dtype, device=w_eNK.device)
    if out.numel():
        # As integers of the element's width: Triton moves bits (no FP8 arithmetic, no casts).
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.element_size()]
        grid = (triton.cdiv(N, 64), triton.cdiv(K, 64), e)
        transpose_kernel[grid](src.view(bits), out.view(bits), N, K, BLOCK_N=64, BLOCK_K=64)
    return out


# The GEMMs are custom ops, opaque to torch.compile, their autograd registered below: traced through (an
# autograd.Function around torch._scaled_grouped_mm, or around an opaque kernel with the quantizations traced),
# compiled input and weight gradients came out wrong on an H200 and zero on an H100, under inductor and aot_eager,
# while the frozen base's FP8 GEMMs, custom ops around the same kernel, compile to eager's results
# (kernels/fp8_frozen.py).
@torch.library.custom_op("moe_tune::fp8_grouped_mm", mutates_args=())
def fp8_rows_by_rows(
    a_RC: torch.Tensor, b_eDC: torch.Tensor, offs_e: torch.Tensor, fast_accum: bool, emulate: bool
) -> torch.Tensor:
    """``out_RD = a_RC @ b_eDC[j]^T`` for the rows of group j: ``a`` quantized per row, ``b`` per (expert, row),
    both over C, the contraction. The forward (a = x, b = the weights ``[e, N, K]``) and the input gradient (a = dy,
    b = the weights ``[e, K, N]``)."""
    aq_RC, sa_R = quantize_rows_fused(a_RC)
    bq_eDC, sb_eD = quantize_rows_fused(b_eDC)
    return _kernel(emulate)(aq_RC, bq_eDC.transpose(-2, -1), sa_R, sb_eD, offs_e, fast_accum).to(a_RC.dtype)


@fp8_rows_by_rows.register_fake
def _(a_RC, b_eDC, offs_e, fast_accum, emulate):
    return a_RC.new_empty(a_RC.shape[0], b_eDC.shape[1])


@torch.library.custom_op("moe_tune::fp8_grouped_mm_weight_grad", mutates_args=())
def fp8_weight_grad(
    dy_RD: torch.Tensor, a_RC: torch.Tensor, offs_e: torch.Tensor, fast_accum: bool, emulate: bool
) -> torch.Tensor:
    """``dy_j^T @ a_j`` for each group j as ``[e, D, C]``: the gradient of ``fp8_rows_by_rows``'s ``b``. It contracts
    over expert j's rows, so both are scaled per (expert, column), over that expert's rows ("2d x 2d" kernel, groups
    along the rows), each group first padded with zero rows to a multiple of 16 (the kernel's alignment)."""
    if a_RC.is_cuda:
        dyq_DP, sdy_eD, padded_offs_e = quantize_padded_group_columns_triton(dy_RD, offs_e)
        aq_CP, sa_eC, _ = quantize_padded_group_columns_triton(a_RC, offs_e)
        sl, sr = sdy_eD.view(-1), sa_eC.view(-1)
        return _kernel(emulate)(dyq_DP, aq_CP.t(), sl, sr, padded_offs_e, fast_accum).to(a_RC.dtype)
    e, R = offs_e.shape[0], a_RC.shape[0]
    dest_R, group_B, padded_offs_e, P = pad_groups(offs_e, R)
    a_PC = a_RC.new_zeros(P, a_RC.shape[1]).index_copy_(0, dest_R, a_RC)
    dy_PD = dy_RD.new_zeros(P, dy_RD.shape[1]).index_copy_(0, dest_R, dy_RD)
    aq_PC, sa_GC = quantize_group_columns(a_PC, group_B, e + 1)
    dyq_PD, sdy_GD = quantize_group_columns(dy_PD, group_B, e + 1)
    left_DP = dyq_PD.t().contiguous()  # row-major left operand
    right_PC = aq_PC.t().contiguous().t()  # column-major right operand
    sl, sr = sdy_GD[:e].contiguous().view(-1), sa_GC[:e].contiguous().view(-1)
    return _kernel(emulate)(left_DP, right_PC, sl, sr, padded_offs_e, fast_accum).to(a_RC.dtype)


@fp8_weight_grad.register_fake
def _(dy_RD, a_RC, offs_e, fast_accum, emulate):
    return a_RC.new_empty(offs_e.shape[0], dy_RD.shape[1], a_RC.shape[1])


def _setup_context(ctx, inputs, output):
    a_RC, b_eDC, offs_e, fast_accum, emulate = inputs
    ctx.save_for_backward(a_RC, b_eDC, offs_e)  # as given (bf16), as for F.grouped_mm
    ctx.fast_accum, ctx.emulate = fast_accum, emulate


def _backward(ctx, dy_RD):
    """Only the gradients autograd asks for: a frozen base (LoRA) runs no weight-gradient GEMM."""
    a_RC, b_eDC, offs_e = ctx.saved_tensors
    dy_RD = dy_RD.contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:
        da = fp8_rows_by_rows(dy_RD, b_eDC.transpose(-2, -1), offs_e, ctx.fast_accum, ctx.emulate)
    if ctx.needs_input_grad[1]:
        db = fp8_weight_grad(dy_RD, a_RC, offs_e, ctx.fast_accum, ctx.emulate).to(b_eDC.dtype)
    return da, db, None, None, None


fp8_rows_by_rows.register_autograd(_backward, setup_context=_setup_context)


def fp8_grouped_mm(
    x_RK: torch.Tensor,
    w_eKN: torch.Tensor,
    offs_e: torch.Tensor,
    emulate: bool | None = None,
    fast_accum: bool = True,
) -> torch.Tensor:
    """``experts.grouped_mm`` in FP8 E4M3 with fp32 power-of-two scales: ``out_RN = x_RK @ w_eKN[j]`` for the rows of
    group j, each of its three GEMMs quantizing both operands on the fly.

    - forward: x per row (one scale per token row, over K); w per (expert, output column n), over K. Each scale
      spans exactly the values one dot product contracts, so an outlier token or column costs precision to itself.
    - input gradient ``dx = dy @ w_j^T``: dy per row (over N); w per (expert, input row k), over N: the other
      axis, for the same reason (the contraction is now over N).
    - weight gradient ``dw_j = x_j^T @ dy_j``: contracts over expert j's tokens, so x and dy are scaled per
      (expert, column), over that expert's rows ("2d x 2d" kernel, groups along the tokens). Each group is first
      padded with zero rows to a multiple of 16 (the kernel's alignment); the zeros add nothing.
    E4M3 everywhere (not E5M2 for gradients): row-wise scales already fit each row's range, and E4M3's extra
    mantissa bit is the better trade.

    ``emulate`` (None: off the GPU) runs ``emulated_scaled_grouped_mm`` in place of the CUDA kernel (``validate``
    refuses the option for runs without an sm90 GPU; CPU tests use the emulation). ``fast_accum``: Hopper's faster
    FP8 accumulation (no periodic promotion to fp32), as torchao's FP8 MoE training uses."""
    emulate = not x_RK.is_cuda if emulate is None else emulate
    # The weights' rows over K are w's columns: for GroupedExperts' "out_in" storage [e, N, K], contiguous rows.
    return fp8_rows_by_rows(x_RK, w_eKN.transpose(-2, -1), offs_e, fast_accum, emulate)
