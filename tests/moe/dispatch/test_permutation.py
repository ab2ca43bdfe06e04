"""The gather-only permutations (``permute_rows``, ``repeat_tokens``) against autograd's own indexing (whose
backward is a scatter): the same values forward, the same gradients backward (fp32, within 1e-6)."""

from __future__ import annotations

import pytest
import torch

from moe_tune.moe.dispatch.base import inverse_permutation, permute_rows, repeat_tokens, sort_by_expert, weighted_sum


def _routing(T: int, K: int, E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return ids_TK, torch.randn(T, 6, generator=g, dtype=torch.float64).float(), g


@pytest.mark.parametrize(("T", "K", "E"), [(13, 1, 4), (17, 2, 8), (9, 4, 4), (1, 2, 8)])
def test_repeat_tokens_and_weighted_sum_equal_indexing_forward_and_backward(T, K, E):
    ids_TK, x_TD, g = _routing(T, K, E)
    order_R, token_R = sort_by_expert(ids_TK)
    inv_R = inverse_permutation(order_R)
    weights_TK = torch.rand(T, K, generator=g)
    upstream_TD = torch.randn(T, 6, generator=g)

    x_new, x_ref = x_TD.clone().requires_grad_(), x_TD.clone().requires_grad_()
    y_new = repeat_tokens(x_new, order_R, inv_R, K)
    y_ref = x_ref[token_R]
    assert torch.equal(y_new, y_ref)
    out_new = weighted_sum(y_new * 2, order_R, inv_R, weights_TK)
    out_ref = torch.bmm(weights_TK.unsqueeze(1), (y_ref * 2)[inv_R].view(T, K, -1)).squeeze(1)
    assert torch.equal(out_new, out_ref)
    (out_new * upstream_TD).sum().backward()
    (out_ref * upstream_TD).sum().backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=0, atol=1e-6)


def test_permute_rows_gradient_is_the_inverse_gather():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 3, generator=g)
    index = torch.randperm(11, generator=g)
    upstream = torch.randn(11, 3, generator=g)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    (permute_rows(a, index, inverse_permutation(index)) * upstream).sum().backward()
    (b[index] * upstream).sum().backward()
    assert torch.equal(a.grad, b.grad)
