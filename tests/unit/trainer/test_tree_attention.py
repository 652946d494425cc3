"""Prefix attention (cached ancestors + causal segment) equals masked SDPA, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer_bridge import tree_attention
from trainer_bridge.tree_attention import prefix_attention_forward


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Query i (position P + i) sees keys 0 … P + i: an explicit lower-right causal mask."""
    q_len, kv_len = q.shape[2], k.shape[2]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.3)
    return out.transpose(1, 2)  # [B, L, H, D]


@pytest.mark.parametrize("path", ["split", "chunked"])
@pytest.mark.parametrize(("prefix", "length"), [(0, 5), (7, 1), (7, 5), (3, 40)])
def test_prefix_attention_matches_the_masked_reference(
    monkeypatch: pytest.MonkeyPatch, path: str, prefix: int, length: int
) -> None:
    if path == "chunked":
        monkeypatch.setattr(tree_attention, "FORCE_CHUNKED", True)
        monkeypatch.setattr(tree_attention, "CHUNK_ELEMENTS", 64)  # several chunks
    gen = torch.Generator().manual_seed(prefix * 100 + length)
    q = torch.randn(2, 4, length, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, prefix + length, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(2, 2, prefix + length, 8, dtype=torch.float64, generator=gen)
    k.requires_grad_(True)
    v.requires_grad_(True)
    weights = torch.randn(2, length, 4, 8, dtype=torch.float64, generator=gen)  # [B, L, H, D]

    got, _ = prefix_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3)
    want = _reference(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grads_got = torch.autograd.grad((got * weights).sum(), (q, k, v))
    grads_want = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w, name in zip(grads_got, grads_want, "qkv", strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)
