"""Attention over packed rows for kernels=torch: the model with ``packed_attention`` (a registered varlen
attention function fed with the rows' sequence boundaries) against transformers' own packed-sequence mask."""

from __future__ import annotations

import pytest
import torch

import moe_tune
from moe_tune.kernels.attention import ATTN_NAME, _varlen, packed_sdpa
from moe_tune.models.model import packed_sequence_kwargs
from moe_tune.models.presets import build_tiny_checkpoint
from tests.tiny import packed_positions

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"), "tiny_qwen3_moe", seed=3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_packed_attention_equals_transformers_packed_mask(checkpoint):
    """Logits and gradients of packed rows: the varlen function (its CPU path, the explicit block mask) against
    transformers' SDPA with the mask it builds from the same position ids; rows of one sequence unchanged."""
    hf_mask = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    varlen = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, packed_attention=True)
    assert varlen.packed_attention and varlen.config._attn_implementation == ATTN_NAME
    assert not hf_mask.packed_attention and hf_mask.config._attn_implementation == "sdpa"
    B, S = 3, 40
    ids = torch.randint(0, varlen.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    pos = packed_positions(B, S, [7, 13, 5, 20])
    for model in (hf_mask, varlen):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, position_ids=pos, return_logits=True)
        out.loss.backward()
    ref = hf_mask(input_ids=ids, position_ids=pos, return_logits=True).logits
    got = varlen(input_ids=ids, position_ids=pos, return_logits=True).logits
    assert _rel(got, ref) < TOL
    # A sequence must not see the one packed before it: its logits equal those of the sequence run alone.
    alone = hf_mask(input_ids=ids[:1, 7:20], return_logits=True).logits
    assert _rel(got[:1, 7:20], alone) < TOL
    for (name, p), q in zip(varlen.named_parameters(), hf_mask.parameters()):
        assert _rel(p.grad, q.grad) < 1e-4, name
    # Rows of one sequence each (no position ids): plain causal attention, as transformers'.
    assert (
        _rel(varlen(input_ids=ids, return_logits=True).logits, hf_mask(input_ids=ids, return_logits=True).logits) < TOL
    )
    with pytest.raises(ValueError, match="takes no attention_mask"):
        varlen(input_ids=ids, attention_mask=torch.ones(B, S, dtype=torch.long))


def test_training_builds_take_no_mask_packed_or_not(checkpoint, monkeypatch):
    """Training builds use the registered function for unpacked rows too: transformers then builds no mask, whose
    search for packed sequences in the position ids is a host sync on every forward."""
    import transformers.masking_utils as masking

    from moe_tune.build import model_options
    from moe_tune.config import Config
    from moe_tune.distributed.dims import ParallelDims

    cfg = Config()
    dims = ParallelDims(1, 1, 1, 1)
    for packing in (True, False):
        cfg.data.packing = packing
        assert model_options(cfg, dims).packed_attention
    searched = []
    original = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda p: (searched.append(1), original(p))[1])
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    for packed, expected in ((True, []), (False, [1])):
        searched.clear()
        model = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, packed_attention=packed)
        model(input_ids=ids, labels=ids)
        assert searched == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_sequences_of_an_eager_family_attend_only_to_themselves(tmp_path, device):
    """GPT-OSS runs its own eager attention (sinks; sliding window 4 on layer 0): in a training build, each packed
    sequence's logits equal transformers' on that sequence alone, and rows of one sequence equal transformers'
    (fp32 on both devices: the masks, not the kernels' rounding, are under test)."""
    from tests.tiny import load_hf, save_tiny

    path = save_tiny(tmp_path / "gpt_oss", "gpt_oss")
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, packed_attention=True)
    ours, ref = ours.eval().to(device), load_hf(path).to(device)
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0)).to(device)
    pos = packed_positions(2, 30, [9, 14, 7]).to(device)
    tol = TOL if device == "cpu" else 1e-3  # TF32 where the GPU allows it
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos).logits
        starts = [0, *torch.nonzero(pos[0] == 0).flatten().tolist()[1:], 30]
        for a, b in zip(starts, starts[1:]):
            assert _rel(got[:1, a:b], ref(input_ids=ids[:1, a:b]).logits) < tol, (a, b)
        assert _rel(ours(input_ids=ids).logits, ref(input_ids=ids).logits) < tol


def test_an_eager_family_under_kernels_te_keeps_packed_sequences_apart(tmp_path, monkeypatch):
    """kernels=te takes SDPA's attention only (``apply_te`` returns False for GPT-OSS's eager attention, after
    swapping its norms and linears; TE cannot run on a CPU, so its swap is left out here): the eager family still
    gets the per-sequence mask, as under kernels=torch."""
    import moe_tune.kernels.te as te
    from tests.tiny import save_tiny

    monkeypatch.setattr(te, "apply_te", lambda model, keep, fp8="none", fp8_options=None: False)
    path = save_tiny(tmp_path / "gpt_oss", "gpt_oss")
    model = moe_tune.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, kernels="te", packed_attention=True
    )
    assert model.packed_attention and model.config._attn_implementation.startswith(ATTN_NAME)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_kernel_matches_the_masked_reference(window, kv_heads):
    """bf16 on a GPU: PyTorch's varlen flash kernel against packed_sdpa's explicit mask (computed in fp32 from
    the same bf16 inputs), forward and backward, GQA and a sliding window included."""
    B, H, S, d = 2, 4, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, h, S, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for h in (H, kv_heads, kv_heads)
    )
    kw = packed_sequence_kwargs(packed_positions(B, S, [9, 30, 17]).cuda())
    cu = kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == 30
    out = _varlen(q, k, v, cu, d**-0.5, window, kw["max_length_q"])
    assert out is not None, "torch.nn.attention.varlen.varlen_attn did not run"
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = packed_sdpa(qr, kr, vr, d**-0.5, cu, window)
    assert _rel(out.float(), ref) < 1e-2
    dy = torch.randn_like(ref)
    out.backward(dy.to(out.dtype))
    ref.backward(dy)
    for got, want in ((q, qr), (k, kr), (v, vr)):
        assert _rel(got.grad.float(), want.grad) < 2e-2
