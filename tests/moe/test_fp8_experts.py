"""kernels.experts=grouped_mm_fp8: the FP8 grouped GEMM (custom ops, their autograd registered) against fp32
grouped_mm, run on CPU with the emulated kernel (dequantized operands in fp32, after the real kernel's meta checks);
on an sm90 GPU with torch._scaled_grouped_mm. The quantizers round-trip, and configs that cannot run it are refused in one line.

Tolerance: E4M3 keeps 3 mantissa bits (relative rounding error up to 2^-4 per value), and both operands of each
GEMM are quantized: on random data the relative error of a product is about 4e-2, so outputs and the three
gradients must be within 5e-2 of fp32 (bf16 alone stays near 4e-3; a wrong scale or group is off by far more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_tune.cli.train import compose, to_config
from moe_tune.config import ConfigError, validate
from moe_tune.env import backends, require_backends
from moe_tune.kernels.fp8_grouped import (
    E4M3_MAX,
    ROW_ALIGN,
    emulated_scaled_grouped_mm,
    fp8_grouped_mm,
    pad_groups,
    quantize_group_columns,
    quantize_rows,
)
from moe_tune.lora import LoRASpec
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts
from tests.harness import compile_for_hopper, triton_interpreted
from tests.tiny import rel_err

FP8_TOL = 5e-2
K, N = 64, 48
COUNTS = {
    "uneven_with_empty": [5, 0, 37, 16, 1, 0],
    "balanced": [16, 16, 16, 16],
    "one_group": [23],
}


def _operands(counts: list[int], extra_rows: int = 0, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + extra_rows
    x = torch.randn(rows, K, generator=g)
    # Stored [e, N, K] (the "out_in" layout) and read as [e, K, N], as GroupedExperts does.
    w = (torch.randn(len(counts), N, K, generator=g) / 8).transpose(-2, -1)
    dy = torch.randn(rows, N, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x.to(device), w.to(device), dy.to(device), offs.to(device)


def _run(mm, x, w, dy, offs, dtype):
    xi = x.to(dtype).requires_grad_()
    wi = w.to(dtype).detach().requires_grad_()
    y = mm(xi, wi, offs)
    y.backward(dy.to(dtype))
    return y, xi.grad, wi.grad


def _fp32_grouped_mm(x, w, offs):
    return F.grouped_mm(x, w, offs=offs)


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_fp8_gemm_and_its_gradients_match_fp32(counts):
    x, w, dy, offs = _operands(counts)
    fp8 = _run(lambda a, b, o: fp8_grouped_mm(a, b, o, emulate=True), x, w, dy, offs, torch.bfloat16)
    ref = _run(_fp32_grouped_mm, x, w, dy, offs, torch.float32)
    for name, a, b in zip(("y", "dx", "dw"), fp8, ref):
        assert a.dtype == torch.bfloat16, name
        err = rel_err(a, b)
        assert err < FP8_TOL, f"{name}: rel err {err:.3f}"
        assert err > 1e-3, f"{name}: rel err {err:.1e} is too small for FP8: did the FP8 path run?"
    for j, n in enumerate(counts):
        if n == 0:  # an expert without rows gets an exactly zero weight gradient
            assert (fp8[2][j] == 0).all()


def test_rows_past_the_last_offset_change_nothing():
    """A fixed-capacity dispatcher (symm_mem) hands rows past offs[-1]: they must not reach the weight gradient."""
    counts = COUNTS["uneven_with_empty"]
    x, w, dy, offs = _operands(counts, extra_rows=7)
    mm = lambda a, b, o: fp8_grouped_mm(a, b, o, emulate=True)  # noqa: E731
    _, _, dw = _run(mm, x, w, dy, offs, torch.bfloat16)
    T = sum(counts)
    x[T:], dy[T:] = 1e4, 1e4  # stale buffer contents, far larger than the real rows
    _, _, dw_stale = _run(mm, x, w, dy, offs, torch.bfloat16)
    torch.testing.assert_close(dw_stale, dw, rtol=0, atol=0)


def test_groups_each_one_row_past_a_block_with_a_padding_row_after_them():
    """The weight gradient's padding at its largest: every group 15 rows short of a block, then a dispatcher's
    padding row, so the padded rows fill the host-side bound to its last row. The three GEMMs match fp32 on the
    real rows within FP8's error."""
    counts = [17, 1, 33, 49]
    x, w, dy, offs = _operands(counts, extra_rows=1)
    fp8 = _run(lambda a, b, o: fp8_grouped_mm(a, b, o, emulate=True), x, w, dy, offs, torch.bfloat16)
    T = sum(counts)
    ref = _run(_fp32_grouped_mm, x[:T], w, dy[:T], offs, torch.float32)
    for name, a, b in zip(("y", "dx", "dw"), (fp8[0][:T], fp8[1][:T], fp8[2]), ref):
        assert rel_err(a, b) < FP8_TOL, name


def test_only_needed_gradients_are_computed(monkeypatch):
    """A frozen base (LoRA) gives no weight gradient: the weight-gradient GEMM must not run."""
    from moe_tune.kernels import fp8_grouped

    x, w, dy, offs = _operands(COUNTS["balanced"])
    calls = []

    def kernel(a, b, *rest):
        calls.append(b.dim())
        return emulated_scaled_grouped_mm(a, b, *rest)

    monkeypatch.setattr(fp8_grouped, "emulated_scaled_grouped_mm", kernel)
    xi = x.to(torch.bfloat16).requires_grad_()
    fp8_grouped_mm(xi, w.to(torch.bfloat16), offs, emulate=True).backward(dy.to(torch.bfloat16))
    assert calls == [3, 3]  # forward and input gradient; no 2d x 2d call
    wi = w.to(torch.bfloat16).requires_grad_()
    fp8_grouped_mm(x.to(torch.bfloat16), wi, offs, emulate=True).backward(dy.to(torch.bfloat16))
    assert calls == [3, 3, 3, 2]  # a frozen input: the weight gradient alone


def test_compiled_gemms_give_eager_results_bit_for_bit():
    """torch.compile (inductor, one graph) calls the three FP8 GEMMs as the custom ops they are: output and both
    gradients equal eager's bit for bit (the quantizations run inside the ops, so nothing is fused differently).
    As an autograd.Function traced by dynamo (the kernel in the graph, or an opaque op with the quantizations
    traced), the compiled gradients were zero on an H100 and wrong on an H200; with the CPU's emulated kernel, right."""
    x, w, dy, offs = _operands(COUNTS["uneven_with_empty"], extra_rows=3)

    def mm(a, b, o):
        return fp8_grouped_mm(a, b, o, emulate=True).float() * 3  # around the op: exact, whatever fuses it

    eager = _run(mm, x, w, dy, offs, torch.bfloat16)
    torch._dynamo.reset()
    compiled = _run(torch.compile(mm, backend="inductor", fullgraph=True), x, w, dy, offs, torch.bfloat16)
    for name, a, b in zip(("y", "dx", "dw"), compiled, eager):
        assert torch.equal(a, b), name


def test_quantize_rows_round_trips():
    t = torch.randn(33, 80) * torch.logspace(-3, 3, 33).unsqueeze(1)  # rows of very different ranges
    t[5] = 0
    q, inv_scale = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and inv_scale.shape == (33,)
    assert torch.equal(torch.exp2(torch.log2(inv_scale).round()), inv_scale)  # powers of two
    back = q.float() * inv_scale[:, None]
    # Round to nearest with 3 mantissa bits: at most 2^-4 relative (values near the row's max, normal range).
    big = t.abs() > t.abs().amax(1, keepdim=True) / 8
    assert ((back - t).abs() <= t.abs() * 2**-4 + 1e-30)[big].all()
    assert (q.float().abs().amax(1)[t.abs().amax(1) > 0] >= E4M3_MAX / 2).all()  # each row uses the top octave
    assert (back[5] == 0).all()
    # Batched over experts along the last dim, from a transposed view: the result is contiguous.
    w = torch.randn(3, 16, 32).transpose(-2, -1)
    qw, sw = quantize_rows(w)
    assert qw.is_contiguous() and sw.shape == (3, 32)
    assert rel_err(qw.float() * sw[..., None], w) < FP8_TOL


def test_pad_groups_places_every_row_in_its_padded_group():
    counts = [5, 0, 37, 16, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = sum(counts) + 4  # four rows of a dispatcher's padding
    dest, group_B, padded_offs, P = pad_groups(offs, rows)
    assert P % ROW_ALIGN == 0 and P >= rows + (ROW_ALIGN - 1) * len(counts) - ROW_ALIGN
    assert padded_offs.tolist() == [16, 16, 64, 80, 96] and padded_offs.dtype == torch.int32
    assert len(set(dest.tolist())) == rows and int(dest.max()) < P
    starts = [0, 16, 16, 64, 80]
    i = 0
    for j, n in enumerate(counts):
        assert dest[i : i + n].tolist() == list(range(starts[j], starts[j] + n))
        i += n
    assert (dest[i:] >= 96).all()  # padding rows after the last group
    block_groups = group_B.tolist()
    assert block_groups[:6] == [0, 2, 2, 2, 3, 4] and set(block_groups[6:]) == {5}


def test_quantize_group_columns_scales_each_group_alone():
    counts = [16, 0, 32]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    t = torch.randn(48, 24)
    t[16:] *= 1000  # group 2's range must not squash group 0's values
    dest, group_B, _, P = pad_groups(offs, 48)
    t_P = t.new_zeros(P, 24).index_copy_(0, dest, t)
    q, inv_scale = quantize_group_columns(t_P, group_B, len(counts) + 1)
    assert inv_scale.shape == (4, 24)
    back = q.float().view(-1, ROW_ALIGN, 24) * inv_scale[group_B].unsqueeze(1)
    back = back.view(P, 24)[dest]
    assert rel_err(back[:16], t[:16]) < FP8_TOL and rel_err(back[16:], t[16:]) < FP8_TOL


def _triton_group_columns_match_pytorch(device: str = "cpu", by_row_tiles: bool = False) -> None:
    """``_group_columns_match_pytorch`` with ``fp8_grouped.COLUMNS_BY_ROW_TILES`` set to ``by_row_tiles``, its
    tiles 16 rows by 16 columns (so that a group spans several tiles and its last one is short)."""
    from moe_tune.kernels import fp8_grouped

    saved = fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.ROW_TILE
    fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.ROW_TILE = by_row_tiles, (16, 16)
    try:
        _group_columns_match_pytorch(device)
    finally:
        fp8_grouped.COLUMNS_BY_ROW_TILES, fp8_grouped.ROW_TILE = saved


def _group_columns_match_pytorch(device: str) -> None:
    """``triton_fp8.quantize_group_columns_kernel`` (or the two kernels over row tiles) in both of its uses against
    the PyTorch path: scales bit for bit;
    the values written into an fp32 buffer (where they land, unrounded), which PyTorch's own E4M3 cast then turns
    into the PyTorch path's bits (Triton's interpreter rounds fp32 to E4M3 its own way; the GPU test compares the
    E4M3 bytes). Masked columns (40 is no multiple of 64), an empty group, a group longer than a block of 64 rows,
    rows past the last group, an all-zero column. On CUDA the wrappers' E4M3 bytes are compared too."""
    from moe_tune.kernels import fp8_grouped
    from moe_tune.kernels.fp8_grouped import (
        E4M3,
        _group_columns_triton,
        quantize_expert_columns_triton,
        quantize_padded_group_columns_triton,
    )

    g = torch.Generator().manual_seed(0)
    counts, C = [5, 0, 70, 16, 3], 40
    R = sum(counts) + 4
    t = (torch.randn(R, C, generator=g) * torch.logspace(-2, 2, C)).to(torch.bfloat16)
    t[:, 7] = 0
    t, offs = t.to(device), torch.tensor(counts).cumsum(0).to(device, torch.int32)
    e = len(counts)
    dest, group_B, padded_ref, P = pad_groups(offs, R)
    q_ref, s_ref = quantize_group_columns(t.new_zeros(P, C).index_copy_(0, dest, t), group_B, e + 1)
    q32 = torch.full((C, P), float("nan"), device=device)
    inv = _group_columns_triton(t, offs, padded_ref, q32, 1, P)
    used = int(padded_ref[-1])
    assert torch.equal(inv, s_ref[:e])
    assert torch.equal(q32[:, :used].t().to(E4M3).view(torch.uint8), q_ref[:used].view(torch.uint8))
    assert q32[:, used:].isnan().all()  # past the last padded group: not written
    q, inv, padded = quantize_padded_group_columns_triton(t, offs)
    assert q.shape == (C, P) and q.dtype == E4M3 and torch.equal(padded, padded_ref) and torch.equal(inv, s_ref[:e])
    if device == "cuda":
        assert torch.equal(q[:, :used].t().view(torch.uint8), q_ref[:used].view(torch.uint8))
    # The input gradient's experts: stored [e, N, K], one scale per (expert, k) over N, written [e, K, N].
    w = (torch.randn(3, 24, C, generator=g) * torch.logspace(-1, 1, 3).view(3, 1, 1)).to(device, torch.bfloat16)
    q_ref, s_ref = quantize_rows(w.transpose(-2, -1))
    bounds = torch.arange(1, 4, dtype=torch.int32, device=device) * 24
    q32 = torch.full((3, C, 24), float("nan"), device=device)
    inv = _group_columns_triton(w.reshape(-1, C), bounds, bounds, q32, C, 24)
    assert torch.equal(inv, s_ref) and torch.equal(q32.to(E4M3).view(torch.uint8), q_ref.view(torch.uint8))
    q, inv = quantize_expert_columns_triton(w)
    assert q.shape == (3, C, 24) and q.is_contiguous() and torch.equal(inv, s_ref)
    # Its three ways (the column kernels per group or by row tiles, the bf16 experts transposed then their rows):
    # the same bytes.
    saved = fp8_grouped.EXPERT_COLUMNS
    for way in ("per_group", "by_row_tiles", "by_transpose"):
        fp8_grouped.EXPERT_COLUMNS = way
        try:
            q_other, inv_other = quantize_expert_columns_triton(w)
        finally:
            fp8_grouped.EXPERT_COLUMNS = saved
        assert torch.equal(q_other.view(torch.uint8), q.view(torch.uint8)) and torch.equal(inv_other, s_ref), way
    if device == "cuda":
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("by_row_tiles", [False, True])
def test_triton_group_columns_equal_pytorch(by_row_tiles):
    triton_interpreted(
        f"import {__name__} as t; t._triton_group_columns_match_pytorch(by_row_tiles={by_row_tiles})",
        "test_cuda_group_columns_equal_pytorch",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run the compiled Triton kernel")
@pytest.mark.parametrize("by_row_tiles", [False, True])
def test_cuda_group_columns_equal_pytorch(by_row_tiles):
    _triton_group_columns_match_pytorch("cuda", by_row_tiles)


def test_triton_group_columns_compile_for_hopper():
    from moe_tune.kernels.triton_fp8 import quantize_group_columns_kernel

    for q_type in ("*fp8e4nv", "*fp32"):
        compile_for_hopper(
            quantize_group_columns_kernel,
            dict(t_ptr="*bf16", q_ptr=q_type, inv_scale_ptr="*fp32", offs_ptr="*i32", out_offs_ptr="*i32"),
            dict(C="i32", t_row_stride="i64", out_group_scale="i64", out_col_stride="i64"),
            dict(BLOCK_R=64, BLOCK_C=64),
        )


def test_triton_group_columns_by_row_tiles_compile_for_hopper():
    from moe_tune.kernels.triton_fp8 import group_column_amax_kernel, quantize_group_columns_by_rows_kernel

    tiles = dict(BLOCK_R=64, BLOCK_C=64, BLOCK_GROUPS=128)
    pointers = dict(t_ptr="*bf16", amax_ptr="*fp32", offs_ptr="*i32", out_offs_ptr="*i32")
    scalars = dict(num_groups="i32", C="i32", t_row_stride="i64")
    compile_for_hopper(group_column_amax_kernel, pointers, scalars, tiles)
    pointers.update(q_ptr="*fp8e4nv", inv_scale_ptr="*fp32")
    scalars.update(out_group_scale="i64", out_col_stride="i64")
    compile_for_hopper(quantize_group_columns_by_rows_kernel, pointers, scalars, tiles)


def test_emulation_refuses_what_the_kernel_refuses():
    """The CPU emulation runs the kernel's own checks: a row-major right operand fails as it would on the GPU."""
    x, w, _, offs = _operands(COUNTS["balanced"])
    xq, sx = quantize_rows(x)
    wq, sw = quantize_rows(w)  # [e, K, N] row-major: the kernel wants the right operand column-major
    with pytest.raises(RuntimeError, match="column major"):
        emulated_scaled_grouped_mm(xq, wq, sx, sw, offs, True)


def _experts(impl: str, lora: LoRASpec | None):
    torch.manual_seed(0)
    m = GroupedExperts(ExpertsSpec(num_experts=4, dim=32, hidden=16), ExpertsOptions(impl=impl), lora=lora)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.to(torch.bfloat16)


@pytest.mark.parametrize("lora", [None, LoRASpec(rank=8, alpha=16)], ids=["full", "lora"])
def test_grouped_experts_pick_the_fp8_gemm(lora):
    """GroupedExperts(impl=grouped_mm_fp8) runs the FP8 GEMMs (not bitwise bf16) and stays within FP8 tolerance,
    adapters included (their deltas stay bf16 grouped_mm). The block chains two FP8 GEMMs: twice the tolerance."""
    fp8, bf16 = _experts("grouped_mm_fp8", lora), _experts("grouped_mm", lora)
    counts = torch.tensor([7, 0, 21, 12])
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y_fp8, y_bf16 = fp8(x, counts), bf16(x, counts)
    assert not torch.equal(y_fp8, y_bf16)
    assert rel_err(y_fp8, y_bf16) < 2 * FP8_TOL
    y_fp8.float().square().sum().backward()
    y_bf16.float().square().sum().backward()
    for (name, a), (_, b) in zip(fp8.named_parameters(), bf16.named_parameters()):
        if b.grad is not None:
            assert rel_err(a.grad, b.grad) < 2 * FP8_TOL, name


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability >= 9.0 (Hopper) for FP8 grouped GEMMs")
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_cuda_kernel_matches_bf16_and_the_emulation(counts):
    x, w, dy, offs = _operands(counts, device="cuda")
    real = _run(lambda a, b, o: fp8_grouped_mm(a, b, o, fast_accum=False), x, w, dy, offs, torch.bfloat16)
    emulated = _run(lambda a, b, o: fp8_grouped_mm(a, b, o, emulate=True), x, w, dy, offs, torch.bfloat16)
    ref = _run(_fp32_grouped_mm, x, w, dy, offs, torch.bfloat16)
    for name, r, e, b in zip(("y", "dx", "dw"), real, emulated, ref):
        assert rel_err(r, b) < FP8_TOL, name
        assert rel_err(r, e) < 1e-2, name  # same quantized operands: only accumulation order and bf16 rounding


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability >= 9.0 (Hopper) for FP8 grouped GEMMs")
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_compiled_gemms_give_eager_results_bit_for_bit(backend):
    """The real kernel and the Triton quantization, compiled (custom ops) and eager: output and both gradients
    equal bit for bit, Qwen3-30B-A3B's gate_up dims, padding rows past the last group. As a traced
    autograd.Function, the compiled gradients were zero (dy reached the backward as zeros) on an H100."""
    g = torch.Generator().manual_seed(0)
    counts = [300, 0, 1200, 548]
    x = torch.randn(sum(counts) + 16, 2048, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(len(counts), 1536, 2048, generator=g) / 40).to("cuda", torch.bfloat16).transpose(-2, -1)
    dy = torch.randn(x.shape[0], 1536, generator=g).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)

    def mm(a, b, o):
        return fp8_grouped_mm(a, b, o).float() * 3

    eager = _run(mm, x, w, dy, offs, torch.bfloat16)
    torch._dynamo.reset()
    compiled = _run(torch.compile(mm, backend=backend, fullgraph=True), x, w, dy, offs, torch.bfloat16)
    rows = sum(counts)  # rows past the last group are left undefined by the kernel
    for name, a, b, r in zip(("y", "dx", "dw"), compiled, eager, (rows, rows, None)):
        assert torch.equal(a[:r], b[:r]), f"{name}: rel err {rel_err(a[:r], b[:r]):.2e}"


@pytest.mark.parametrize(
    "hidden, fix",
    [
        (776, "kernels.experts=grouped_mm"),  # bf16 grouped_mm takes multiples of 8
        (780, "kernels.experts=loop"),  # and refuses 780 in turn: the loop is the fix
    ],
)
def test_config_refuses_unaligned_expert_dims_with_a_fix_that_passes(hidden, fix):
    """The suggested kernel is one that validate then accepts: at 780 (no multiple of 8) grouped_mm's 16-byte rows
    in bf16 refuse it too."""
    cfg = to_config(compose(["kernels.experts=grouped_mm_fp8"]))
    validate(cfg, world_size=1, expert_dims=(2048, 768))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, expert_dims=(2048, hidden))
    assert str(e.value) == (
        f"kernels.experts=grouped_mm_fp8 needs the model dim (2048) and the expert hidden dim ({hidden}) to be "
        f"multiples of 16 (the FP8 grouped GEMM's alignment); use {fix} for this model"
    )
    validate(to_config(compose([fix])), world_size=1, expert_dims=(2048, hidden))


@pytest.mark.parametrize(
    "gpu,message",
    [
        (None, "kernels.experts=grouped_mm_fp8 needs a CUDA GPU and none is visible here"),
        (("NVIDIA A100", (8, 0)), "kernels.experts=grouped_mm_fp8 needs compute capability >= 9.0"),
    ],
)
def test_backend_check_refuses_without_sm90(monkeypatch, gpu, message):
    monkeypatch.setattr(backends, "_cuda", lambda: gpu)
    cfg = to_config(compose(["kernels.experts=grouped_mm_fp8"]))
    assert "grouped_mm_fp8" in backends.backends_needed(cfg)
    with pytest.raises(ConfigError) as e:
        require_backends(cfg)
    assert message in str(e.value) and str(e.value).endswith("use kernels.experts=grouped_mm")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA H200", (9, 0)))
    require_backends(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_exits_2_without_a_gpu(tmp_path):
    from tests.config.test_overrides import _moe_tune

    r = _moe_tune([f"output_dir={tmp_path / 'run'}", "kernels.experts=grouped_mm_fp8"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "kernels.experts=grouped_mm_fp8 needs a CUDA GPU" in r.stderr
