"""Attention for one prefix-tree segment: all cached ancestor keys, causal within the segment.

A segment of ``L`` new tokens runs with the ``P`` keys of its ancestors in the KV cache. Query
``i`` (position ``P + i``) attends to keys ``0 … P + i``: a *lower-right* causal pattern. PyTorch's
``is_causal`` is top-left aligned, so Hugging Face's ``sdpa`` path builds an explicit
``[L, P + L]`` mask for it, and the CPU kernel saves that mask (as float) for backward: measured
~90 MB per layer for ``L = 2,000, P = 8,000``, i.e. ``4·L·(P + L)`` bytes — quadratic in a long
segment, which a 100k-token batch cannot afford.

``prefix_attention_forward`` is registered with Hugging Face's ``AttentionInterface`` under
:data:`PREFIX_ATTENTION` (and deliberately *not* with the mask interface, so the model passes no
mask at all). A segment without ancestors (``P = 0``) is plain ``is_causal`` SDPA. Otherwise:

- **split** (CPU, the default): two mask-free flash-attention calls — the segment's queries over
  the ancestors' keys (everything visible) and over its own keys (square, ``is_causal``) — merged
  by their log-sum-exps; backward runs the flash backward of each key block with the merged
  output and log-sum-exp (``_PrefixThenCausal``). Memory O(L) beyond q, k, v; measured for
  ``L = 1,750, P = 8,000`` (one head pair, fwd + bwd): 0.3–0.4 s against 0.9–1.0 s for chunked.
- **chunked** (elsewhere, or ``FORCE_CHUNKED``): the queries in chunks of at most
  ``CHUNK_ELEMENTS / (P + L)`` rows, each over keys ``[0, P + end)`` with a small mask, under
  ``torch.utils.checkpoint`` so the mask is rebuilt in backward instead of kept.

:func:`prefix_attention` switches a model to it for the duration of a ``with`` block (the padded
path never sees it). Dropout is refused: the learner runs in eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer_bridge.errors import TrainerError

PREFIX_ATTENTION = "tree_prefix_sdpa"
#: Mask entries of one query chunk (queries × visible keys): 2^22 ≈ 4M, a 16 MB float mask.
CHUNK_ELEMENTS = 1 << 22
#: Use the chunked-mask path even where the split flash path is available (measurements, tests).
FORCE_CHUNKED = False


def _chunk_attention(
    query: torch.Tensor,  # [B, H, c, D]
    key: torch.Tensor,  # [B, Hkv, K, D], the keys this chunk may see (K = P + end)
    value: torch.Tensor,  # [B, Hkv, K, D]
    diagonal: int,  # query i sees keys j <= i + diagonal
    scaling: float | None,
) -> torch.Tensor:
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1)  # [B, H, K, D]
    value = value.repeat_interleave(n_rep, dim=1)  # [B, H, K, D]
    visible = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
    visible = visible.tril(diagonal=diagonal)  # [c, K]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling)


class _PrefixThenCausal(torch.autograd.Function):
    """softmax over [prefix keys (all visible), own keys (causal)] from two flash calls.

    Forward: flash attention over the prefix (no mask) and over the segment's own keys
    (``is_causal``, square, so top-left is right), merged by their log-sum-exps:
    ``o = e^(l₁ − l)·o₁ + e^(l₂ − l)·o₂`` with ``l = log(e^l₁ + e^l₂)``. Backward: the flash
    backward of each key block, given the *merged* output and log-sum-exp, is exactly that
    block's share of the full attention's gradient (it recomputes ``P = exp(S − l)`` and
    ``D = rowsum(dO ∘ O)``); the two query gradients add. No mask, nothing quadratic saved.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,  # [B, H, L, D]
        key_prefix: torch.Tensor,  # [B, H, P, D]
        value_prefix: torch.Tensor,  # [B, H, P, D]
        key_own: torch.Tensor,  # [B, H, L, D]
        value_own: torch.Tensor,  # [B, H, L, D]
        scale: float | None,
    ) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_prefix, lse_prefix = flash(query, key_prefix, value_prefix, 0.0, False, scale=scale)
        out_own, lse_own = flash(query, key_own, value_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)  # [B, H, L]
        weight_prefix = torch.exp(lse_prefix - lse).unsqueeze(-1)  # [B, H, L, 1]
        weight_own = torch.exp(lse_own - lse).unsqueeze(-1)  # [B, H, L, 1]
        out = out_prefix * weight_prefix + out_own * weight_own  # [B, H, L, D]
        ctx.save_for_backward(query, key_prefix, value_prefix, key_own, value_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key_prefix, value_prefix, key_own, value_own, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        dq_prefix, dk_prefix, dv_prefix = backward(
            grad_out, query, key_prefix, value_prefix, out, lse, 0.0, False, scale=ctx.scale
        )
        dq_own, dk_own, dv_own = backward(
            grad_out, query, key_own, value_own, out, lse, 0.0, True, scale=ctx.scale
        )
        return dq_prefix + dq_own, dk_prefix, dv_prefix, dk_own, dv_own, None


def _split_attention(
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, P + L, D]
    value: torch.Tensor,  # [B, Hkv, P + L, D]
    prefix: int,
    scaling: float | None,
) -> torch.Tensor:
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1)  # [B, H, P + L, D]
    value = value.repeat_interleave(n_rep, dim=1)  # [B, H, P + L, D]
    out: torch.Tensor = _PrefixThenCausal.apply(
        query.contiguous(),
        key[:, :, :prefix].contiguous(),
        value[:, :, :prefix].contiguous(),
        key[:, :, prefix:].contiguous(),
        value[:, :, prefix:].contiguous(),
        scaling,
    )
    return out


def _chunked_attention(
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, P + L, D]
    value: torch.Tensor,  # [B, Hkv, P + L, D]
    prefix: int,
    scaling: float | None,
) -> torch.Tensor:
    q_len, kv_len = query.shape[2], key.shape[2]
    chunk = max(1, min(q_len, CHUNK_ELEMENTS // kv_len))
    parts: list[torch.Tensor] = []
    for start in range(0, q_len, chunk):
        end = min(q_len, start + chunk)
        visible_keys = prefix + end
        args = (
            query[:, :, start:end],  # [B, H, c, D]
            key[:, :, :visible_keys],  # [B, Hkv, P + end, D]
            value[:, :, :visible_keys],  # [B, Hkv, P + end, D]
            prefix + start,
            scaling,
        )
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_attention, *args, use_reentrant=False)
        else:
            part = _chunk_attention(*args)
        parts.append(part)
    return torch.cat(parts, dim=2)  # [B, H, L, D]


def _has_cpu_flash(query: torch.Tensor) -> bool:
    aten = torch.ops.aten
    return query.device.type == "cpu" and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def prefix_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, P + L, D], ancestors first
    value: torch.Tensor,  # [B, Hkv, P + L, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function; returns ``([B, L, H, D], None)``."""
    if attention_mask is not None:
        raise TrainerError("prefix attention takes no mask (tree segments are never padded)")
    if dropout != 0.0:
        raise TrainerError("prefix attention runs in eval mode only (dropout must be 0)")
    q_len, kv_len = query.shape[2], key.shape[2]
    prefix = kv_len - q_len  # P, the ancestors' keys
    if prefix == 0:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=True
        )  # [B, H, L, D]
        return out.transpose(1, 2).contiguous(), None

    if _has_cpu_flash(query) and not FORCE_CHUNKED:
        out = _split_attention(query, key, value, prefix, scaling)  # [B, H, L, D]
    else:
        out = _chunked_attention(query, key, value, prefix, scaling)  # [B, H, L, D]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PREFIX_ATTENTION, prefix_attention_forward)


@contextlib.contextmanager
def prefix_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through :func:`prefix_attention_forward` inside the block."""
    _register()
    set_impl = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if set_impl is None or config is None:
        raise TrainerError("tree packing needs a Hugging Face model (set_attn_implementation)")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise TrainerError(
            f"tree packing supports full-attention models only (layer types: {sorted(layer_types)})"
        )
    previous = config._attn_implementation
    set_impl(PREFIX_ATTENTION)
    try:
        yield
    finally:
        set_impl(previous)
