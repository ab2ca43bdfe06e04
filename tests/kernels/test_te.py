"""kernels=te.

On CPU (no TransformerEngine): packed rows' sequence boundaries reach a registered attention function as
transformers' ``cu_seq_lens_q`` and give the same logits as transformers' own packed-sequence mask, for every
family that uses SDPA; the SDPA fallback of te.py is that reference's equal.
On an H200 with TransformerEngine installed (skipped otherwise): kernels=te against kernels=torch in bf16 for
logits, loss and every gradient, packed and unpacked, and FP8 (current and delayed scaling) close to bf16.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AttentionInterface

import moe_tune
from moe_tune.kernels.attention import packed_sdpa
from moe_tune.kernels.te import _fp8_shape_ok
from moe_tune.models.model import packed_sequence_kwargs
from tests.harness import needs_te
from tests.tiny import FAMILIES, VOCAB, build_hf, packed_positions, rel_err


def test_fp8_shape_rule():
    """A linear TE cannot quantize stays torch (outside FP8): dims multiple of 16, or of 128 for block scaling."""
    assert _fp8_shape_ok(torch.nn.Linear(256, 48))
    assert not _fp8_shape_ok(torch.nn.Linear(256, 1))  # Qwen2-MoE's shared_expert_gate
    assert _fp8_shape_ok(torch.nn.Linear(256, 384), 128)
    assert not _fp8_shape_ok(torch.nn.Linear(256, 48), 128)


class _Recipe:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@pytest.fixture
def stub_te_recipes(monkeypatch):
    """transformer_engine.common.recipe as classes that keep their arguments (TE is not installed on CPU)."""
    import types

    names = ("Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling", "MXFP8BlockScaling", "MMParams")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in names:
        setattr(recipe, name, type(name, (_Recipe,), {}))
    recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)


def test_fp8_recipe_per_mode_with_the_configs_options(stub_te_recipes):
    from moe_tune.config import KernelsConfig
    from moe_tune.kernels.te import fp8_recipe

    delayed = KernelsConfig(fp8="delayed", fp8_amax_history_len=16, fp8_amax_compute_algo="most_recent")
    r = fp8_recipe("delayed", **delayed.fp8_options())
    assert type(r).__name__ == "DelayedScaling" and (r.amax_history_len, r.amax_compute_algo) == (16, "most_recent")
    current = KernelsConfig(fp8="current", fp8_fprop_split_accumulator=True)
    r = fp8_recipe("current", **current.fp8_options())
    assert type(r).__name__ == "Float8CurrentScaling" and r.fp8_gemm_fprop.use_split_accumulator is True
    assert fp8_recipe("current").fp8_gemm_fprop.use_split_accumulator is False
    assert not hasattr(fp8_recipe("current"), "backward_override")  # TE's default (and its env variable) stand
    bf16_backward = KernelsConfig(fp8="blockwise", fp8_backward="high_precision")
    assert fp8_recipe("blockwise", **bf16_backward.fp8_options()).backward_override == "high_precision"
    assert fp8_recipe("current", backward="dequantized").backward_override == "dequantized"
    assert type(fp8_recipe("blockwise")).__name__ == "Float8BlockScaling"
    assert type(fp8_recipe("mxfp8")).__name__ == "MXFP8BlockScaling"
    assert not hasattr(fp8_recipe("current"), "fp8_format")  # the recipe's own format (HYBRID there)
    e4m3 = KernelsConfig(fp8="current", fp8_format="e4m3")
    assert fp8_recipe("current", **e4m3.fp8_options()).fp8_format == "E4M3"
    assert fp8_recipe("delayed", fp8_format="e4m3").fp8_format == "E4M3"
    with pytest.raises(ValueError, match="kernels.fp8='fp4' is not one of"):
        fp8_recipe("fp4")


@pytest.fixture
def stub_te(monkeypatch, stub_te_recipes):
    """transformer_engine.pytorch with Linear/RMSNorm of TE's constructor signatures and an autocast that records
    its recipe: enough to check which modules kernels=te swaps, on CPU."""
    import contextlib
    import types

    from torch import nn

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

    class RMSNorm(nn.RMSNorm):
        def __init__(self, hidden_size, eps=1e-6, dtype=None, device=None):
            super().__init__(hidden_size, eps=eps, dtype=dtype, device=device)

    recipes = []

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        recipes.append(recipe)
        te.depth += 1
        yield
        te.depth -= 1

    te = types.ModuleType("transformer_engine.pytorch")
    te.Linear, te.RMSNorm, te.autocast, te.depth = Linear, RMSNorm, autocast, 0
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    sys.modules["transformer_engine"].pytorch = te
    return te, recipes


@pytest.mark.parametrize("fp8", ["current", "blockwise"])
def test_te_swaps_the_dense_linears_fp8_can_take(stub_te, fp8, tiny_checkpoint, caplog):
    """q_proj/o_proj (192 wide) and k/v_proj (96) are multiples of 16, not of 128: current scaling takes them,
    block scaling leaves them torch (logged); norms are TE's, the router and lm_head are never touched, weights
    are copied, and each decoder layer runs under the recipe's autocast."""
    te, recipes = stub_te
    path = tiny_checkpoint("qwen3_moe", **{**TE_SHAPES, "head_dim": 48})
    plain = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    q_before = plain.layers[0].self_attn.q_proj.weight.detach().clone()
    router_type, head_type = type(plain.moe_layers()[0].router), type(plain.lm_head)
    with caplog.at_level("INFO", logger="moe_tune"):
        model = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, kernels="te", fp8=fp8)
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, te.Linear) == (fp8 == "current")
    assert isinstance(attn.k_proj, te.Linear) == (fp8 == "current")
    assert ("8 linears stay torch" in caplog.text) == (fp8 == "blockwise")  # 4 per layer, 2 layers
    assert isinstance(model.layers[0].input_layernorm, te.RMSNorm) and isinstance(model.model.norm, te.RMSNorm)
    assert type(model.moe_layers()[0].router) is router_type and type(model.lm_head) is head_type
    torch.testing.assert_close(attn.q_proj.weight, q_before, rtol=0, atol=0)
    # A layer's forward runs inside the autocast, left afterwards (the layer's own forward swapped for a marker:
    # TE attention cannot run here; the hooks stay the layer's).
    layer = model.layers[1]
    layer.forward = lambda: te.depth
    assert layer() == 1 and te.depth == 0
    layer.forward = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        layer()
    assert te.depth == 0  # left on an error too
    assert type(recipes[-1]).__name__ == ("Float8CurrentScaling" if fp8 == "current" else "Float8BlockScaling")


def test_packed_sequence_kwargs():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # the second row starts mid-sequence
    kw = packed_sequence_kwargs(pos)
    assert kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 8, 12]
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 4  # sequences of 3, 2, 1, 2 and 4 tokens


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_fallback_masks_equal_an_explicit_loop(packed, window):
    """te.py's SDPA fallback (GQA, causal, packed sequences, sliding window) against softmax written out."""
    g = torch.Generator().manual_seed(0)
    B, H, KV, S, d = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(B, h, S, d, generator=g) for h in (H, KV, KV))
    pos = packed_positions(B, S, [4, 3, 6]) if packed else torch.arange(S).expand(B, S)
    cu = packed_sequence_kwargs(pos)["cu_seq_lens_q"] if packed else None
    out = packed_sdpa(q, k, v, 0.5, cu, window)  # [B, S, H, d]
    seq = (pos == 0).cumsum(1)  # sequence number of each position in its row
    for b in range(B):
        for h in range(H):
            for i in range(S):
                ok = [j for j in range(i + 1) if seq[b, j] == seq[b, i] and (window is None or i - j < window)]
                w = torch.softmax(0.5 * k[b, h // 2, ok] @ q[b, h, i], dim=0)
                torch.testing.assert_close(out[b, i, h], w @ v[b, h // 2, ok], rtol=1e-5, atol=1e-5)


SDPA_FAMILIES = [f for f in FAMILIES if f != "gpt_oss"]  # GPT-OSS keeps eager attention (its sinks)


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_cu_seqlens_reach_attention_and_match_transformers_packed_mask(family, tiny_checkpoint):
    model = moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    B, S = 2, 12
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    pos = packed_positions(B, S, [5, 3, 4])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, return_logits=True).logits  # transformers' packed mask
    seen = []

    def spy(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert attention_mask is None  # a registered function gets no mask from transformers
        seen.append(kwargs["cu_seq_lens_q"])
        return packed_sdpa(query, key, value, scaling, kwargs["cu_seq_lens_q"]), None

    AttentionInterface.register("moe_tune_test_spy", spy)
    model.config._attn_implementation = "moe_tune_test_spy"
    model.packed_attention = True  # as kernels=te builds it
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, return_logits=True).logits
    assert len(seen) == model.config.num_hidden_layers
    assert seen[0].tolist() == packed_sequence_kwargs(pos)["cu_seq_lens_q"].tolist()
    assert rel_err(out, ref) < 1e-5
    # One row of positions for the whole batch (broadcast, as transformers allows): boundaries for every row.
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos[:1], return_logits=True)
    assert seen[0].tolist() == packed_sequence_kwargs(pos[:1].expand(B, S))["cu_seq_lens_q"].tolist()
    # A padding mask is refused, not ignored (transformers would hand the registered function no mask).
    with torch.no_grad(), pytest.raises(ValueError, match="takes no attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones(B, S, dtype=torch.long))
    # Rows of one sequence each (no position ids): no boundaries are passed.
    seen.clear()
    with torch.no_grad(), pytest.raises(KeyError):
        model(input_ids=ids, return_logits=True)


# -- on an H200 with TransformerEngine ----------------------------------------------------------------------
TE_SHAPES = dict(
    vocab_size=512,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    moe_intermediate_size=128,
    intermediate_size=256,
    max_position_embeddings=512,
)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, ids, pos):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, position_ids=pos, return_logits=True)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), _grads(model)


def _checkpoint(tmp_path) -> str:
    """A tiny Qwen3-MoE checkpoint at a trained model's scale (weights ~0.02, not tests/tiny.py's 0.2, which
    makes activations so large that any bf16 rounding moves the logits by percents)."""
    model = build_hf("qwen3_moe", **TE_SHAPES)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.1)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def _load(path, dtype, kernels="torch", **options):
    # Forced balanced routing: both kernel sets send every token to the same experts, so the comparison
    # measures kernels, not top-k ties flipped by bf16 rounding (which move whole expert outputs).
    return moe_tune.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, kernels=kernels, device="cuda", force_balanced_routing=True, **options
    )


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_te_matches_torch_in_bf16(packed, tmp_path):
    """bf16 tolerance, stated: against an fp32 reference, kernels=te's bf16 error is at most 1.5x (logits,
    loss) or 2x (each gradient) kernels=torch's bf16 error, plus a small floor."""
    path = _checkpoint(tmp_path)
    fp32, torch_bf16, te_bf16 = (
        _load(path, torch.float32),
        _load(path, torch.bfloat16),
        _load(path, torch.bfloat16, "te"),
    )
    assert sorted(dict(te_bf16.named_parameters())) == sorted(dict(torch_bf16.named_parameters()))
    assert type(te_bf16.layers[0].self_attn.q_proj).__module__.startswith("transformer_engine")
    B, S = 2, 256
    ids = torch.randint(0, 512, (B, S), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = packed_positions(B, S, [100, 37, 60]).cuda() if packed else None
    ref_logits, ref_loss, ref_grads = _run(fp32, ids, pos)
    t_logits, t_loss, t_grads = _run(torch_bf16, ids, pos)
    e_logits, e_loss, e_grads = _run(te_bf16, ids, pos)
    torch_err, te_err = rel_err(t_logits, ref_logits), rel_err(e_logits, ref_logits)
    assert te_err <= 1.5 * torch_err + 2e-3, (te_err, torch_err)
    assert abs(float(e_loss - ref_loss)) <= 1.5 * abs(float(t_loss - ref_loss)) + 2e-3 * float(ref_loss)
    assert sorted(e_grads) == sorted(ref_grads)
    bad = {}
    for n, g in ref_grads.items():
        t, e = rel_err(t_grads[n], g), rel_err(e_grads[n], g)
        if e > 2 * t + 1e-2:
            bad[n] = (e, t)
    assert not bad


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize(
    "fp8,options",
    [
        ("current", {}),
        ("delayed", {}),
        ("blockwise", {}),
        ("current", {"fprop_split_accumulator": True}),
        ("current", {"backward": "high_precision"}),
        ("current", {"fp8_format": "e4m3"}),
    ],
    ids=["current", "delayed", "blockwise", "current_split_accumulator", "current_forward_only", "current_e4m3"],
)
def test_fp8_close_to_bf16(fp8, options, tmp_path):
    """FP8 (E4M3 forward, 3 mantissa bits) on the attention GEMMs: finite, logits within 10% and the loss
    within 2% of the fp32 reference."""
    path = _checkpoint(tmp_path)
    fp32 = _load(path, torch.float32)
    model = _load(path, torch.bfloat16, "te", fp8=fp8, fp8_options=options)
    ids = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref_logits, ref_loss, _ = _run(fp32, ids, None)
    for _ in range(2):  # delayed scaling uses the amax of earlier steps: check a second step too
        logits, loss, grads = _run(model, ids, None)
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert rel_err(logits, ref_logits) < 0.1
    assert abs(float(loss - ref_loss)) / float(ref_loss) < 2e-2
