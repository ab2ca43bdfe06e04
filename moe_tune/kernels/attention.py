"""Attention over packed rows for ``kernels=torch``: each packed sequence attends only to itself, through
PyTorch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``) on CUDA.

Without it transformers builds a dense [B, 1, S, S] block-diagonal mask from the position ids, and SDPA with a
mask cannot take the flash kernel. ``varlen_attention_forward`` is registered as a transformers attention
function (``ATTN_NAME``); ``MoECausalLM`` passes packed rows' boundaries as transformers' ``cu_seq_lens_q/k``
keywords. Rows of one sequence each (no boundaries) run SDPA's causal flash path. What the varlen kernel cannot
take (CPU tensors, attention dropout, v head size unlike q's, a torch without it) runs ``packed_sdpa``: the same
maths with an explicit mask. A family with no SDPA path (GPT-OSS's attention sinks) runs its own eager attention
with that mask (``packed_eager_forward``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

ATTN_NAME = "moe_tune_varlen"


def packed_sdpa(query, key, value, scaling, cu_seqlens=None, window=None, dropout=0.0) -> torch.Tensor:
    """Causal SDPA on [B, heads, S, d] (kv heads repeated), block-diagonal over packed sequences when
    ``cu_seqlens`` (offsets of every sequence in the flattened B*S tokens) is given, banded when ``window``
    (tokens seen, the query's own included) is. Returns [B, S, heads, d]."""
    B, H, S, _ = query.shape
    gqa = key.shape[1] != H
    if cu_seqlens is None and not window:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous()
    rep = H // key.shape[1]  # kv heads repeated: the masked kernels do not all take enable_gqa
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    mask = packed_mask(B, S, cu_seqlens, window, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def packed_mask(B: int, S: int, cu_seqlens=None, window=None, device=None) -> torch.Tensor:
    """[B, 1, S, S] bool, True where a query may attend: causal, banded when ``window`` (tokens seen, the query's
    own included), block-diagonal over the packed sequences of ``cu_seqlens`` (offsets in the flattened B*S)."""
    i = torch.arange(S, device=device)
    mask = (i.unsqueeze(1) >= i.unsqueeze(0)).expand(B, 1, S, S)  # causal
    if window:
        mask = mask & (i.unsqueeze(1) - i.unsqueeze(0) < window)
    if cu_seqlens is not None:
        seq = torch.zeros(B * S, dtype=torch.int32, device=device)
        seq[cu_seqlens[1:-1].long()] = 1
        seq = seq.cumsum(0).view(B, 1, S)
        mask = mask & (seq.unsqueeze(-1) == seq.unsqueeze(-2))
    return mask


def _find_varlen_kernel():
    """(varlen_attn, how it takes causality and GQA) or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


# Looked up once, at import: called inside the compiled layers, a functools.cache'd lookup made dynamo print a
# 7-line warning at every compile.
VARLEN_KERNEL = _find_varlen_kernel()


def _varlen(query, key, value, cu, scaling, window, longest: int | None = None) -> torch.Tensor | None:
    """The flash kernel on [B, heads, S, d] q/k/v, or None where it cannot run them. ``longest``: the longest
    packed sequence (the kernel's grid is sized by it; default the row length)."""
    kernel = VARLEN_KERNEL
    if kernel is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    varlen_attn, has_window, has_gqa = kernel
    B, H, S, d = query.shape
    if not has_window and window:
        return None
    if not has_gqa:
        rep = H // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (t.transpose(1, 2).reshape(B * S, t.shape[1], d) for t in (query, key, value))  # thd
    options = {"scale": scaling}
    if has_window:  # (left, right): right 0 is causal; left -1 unbounded, else the tokens before the query
        options["window_size"] = (window - 1 if window else -1, 0)
    else:
        options["is_causal"] = True
    if has_gqa:
        options["enable_gqa"] = key.shape[1] != H
    longest = S if longest is None else longest
    return varlen_attn(q, k, v, cu, cu, longest, longest, **options).view(B, S, H, d)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: q/k/v arrive [B, heads, S, head_dim] (kv heads not repeated); returns
    ([B, S, heads, head_dim], None). No mask ever arrives (transformers builds none for a registered function,
    and MoECausalLM refuses one): packed rows come with ``cu_seq_lens_q``."""
    cu = kwargs.get("cu_seq_lens_q")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if cu is not None and not dropout and query.shape[-1] == value.shape[-1]:
        out = _varlen(query, key, value, cu, scaling, window, kwargs.get("max_length_q"))
        if out is not None:
            return out, None
    return packed_sdpa(query, key, value, scaling, cu, window, dropout), None


def packed_eager_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, eager, **kwargs):
    """transformers attention function for a family whose attention only its own eager code computes (GPT-OSS's
    sinks): ``eager``, its modeling module's ``eager_attention_forward``, given the additive mask of ``packed_mask``
    (causal, the layer's sliding window, one block per packed sequence of ``cu_seq_lens_q``). No mask arrives, as
    for ``varlen_attention_forward``."""
    B, _, S, _ = query.shape
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    allowed = packed_mask(B, S, kwargs.get("cu_seq_lens_q"), window, query.device)
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
