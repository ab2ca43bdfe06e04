"""NF4 dequantization in one pass (``moe_tune.kernels.nf4_frozen`` launches it on CUDA). A module-level function, so
that Triton's interpreter (``TRITON_INTERPRET=1``) resolves it by name; imported only when the kernel is launched
(CPU installs need not have Triton)."""

import triton
import triton.language as tl


@triton.jit
def dequantize_kernel(
    codes_ptr, scales_ptr, table_ptr, out_ptr, half_k, block, BLOCK_BYTES: tl.constexpr, JOINED: tl.constexpr
):
    """One program per (row, block of ``BLOCK_BYTES`` code bytes) of ``codes`` [rows, half_k] (two codes per byte,
    the lower nibble first): ``out[row, 2j + i] = table[code] * scales[row, (2j + i) // block]`` in out's dtype, the
    product taken in fp32 as ``nf4_frozen.dequantize_weight`` takes it. ``JOINED``: the two nibbles' values
    interleaved in registers and stored as one contiguous run; otherwise two stores, each to every other element."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = j < half_k
    byte = tl.load(codes_ptr + row * half_k + j, mask=mask, other=0).to(tl.int32)
    scales_per_row = (2 * half_k) // block
    scale = tl.load(scales_ptr + row * scales_per_row + (2 * j) // block, mask=mask, other=0.0).to(tl.float32)
    low = tl.load(table_ptr + (byte & 0xF), mask=mask, other=0.0) * scale
    high = tl.load(table_ptr + (byte >> 4), mask=mask, other=0.0) * scale
    out = out_ptr + row * 2 * half_k
    if JOINED:
        i = tl.program_id(1) * 2 * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
        values = tl.interleave(low, high).to(out_ptr.dtype.element_ty)
        tl.store(out + i, values, mask=i < 2 * half_k)
    else:
        tl.store(out + 2 * j, low.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + 2 * j + 1, high.to(out_ptr.dtype.element_ty), mask=mask)
