"""How the learner turns a batch into token logprobs: ``padded`` rows or a ``tree`` of prefixes.

Both return ``[B, T]`` logprobs aligned with ``batch.input_ids`` (position t holds
log π(input_ids[t] | input_ids[:t])), so the loss (``loss.policy_loss``), the advantages and the
global owned-token normalisation are the very same code for both; only what the forward pass
computes differs.

- ``padded``: one forward over the right-padded ``[B, T]`` batch; every row's every token (and
  the pads) is computed, logits at every position.
- ``tree``: the rows merged into a prefix forest (``tree.py``) across rows and episodes; each
  distinct token is computed once, attending only to its ancestors, at its path position.

Why KV reuse (and not one packed sequence with an ancestor mask): a packed sequence of N
distinct tokens needs an ``N × N`` ancestor mask — 10 GB as bool at N = 100k, and SDPA keeps a
float copy for backward — while running the forest segment by segment with the ancestors' keys
and values in a ``DynamicCache`` needs only what the segment's queries see, and is any Hugging
Face causal LM's own forward (nothing to re-implement but the lower-right causal attention,
``tree_attention.py``, which keeps memory linear). Segments run in preorder: a segment's cache is
its parent's full K/V, positions continue from the parent's length, and gradients flow through
the cached K/V into the shared segment (the cache holds the autograd graph's tensors, never
detached copies). A segment's K/V are dropped once its last running child has run.

Only the logits the loss reads are computed (``logits_to_keep``): at the predicting position of
each scored (row, position), deduplicated. A child segment's first token is scored from the
parent's last position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer_bridge.errors import TrainerError
from trainer_bridge.tree import TreePlan, plan_scores
from trainer_bridge.tree_attention import prefix_attention


@dataclass(frozen=True, slots=True)
class Packed:
    logprobs: torch.Tensor  # [B, T], 0 at position 0 and wherever nothing was scored
    computed_tokens: int  # tokens the forward pass processed (padded: B·T, pads included)


#: (model, module to call — the model or its DDP wrapper, input_ids [B, T],
#:  attention_mask [B, T], score_mask [B, T] positions whose logprob is needed) → Packed
PackingFn = Callable[[nn.Module, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], Packed]


def _float_logits(logits: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16/fp16 are upcast), float64 kept (exactness tests)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def padded_logprobs(
    model: nn.Module,
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
) -> Packed:
    """The whole padded batch in one forward; logprobs at every real position."""
    logits = module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp_all = torch.log_softmax(_float_logits(logits[:, :-1]), dim=-1)  # [B, T-1, V]
    next_ids = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    logp = logp_all.gather(-1, next_ids).squeeze(-1)  # [B, T-1]
    logp = F.pad(logp, (1, 0))  # [B, T], position 0 has no prefix
    return Packed(logp * attention_mask.to(logp.dtype), int(input_ids.numel()))


def _run_tree(model: nn.Module, module: nn.Module, plan: TreePlan) -> list[torch.Tensor]:
    """Forward every running segment in preorder; the logprobs of each segment's pairs."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    segments = plan.forest.segments
    waiting = plan.running_children()  # [S] children still to run, per segment
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    pair_logp: list[torch.Tensor] = []
    for s, seg in enumerate(segments):
        n = int(plan.run_length[s])
        if n == 0:
            continue
        keeps_kv = waiting[s] > 0
        cache = DynamicCache(ddp_cache_data=kv[seg.parent]) if seg.parent >= 0 else None
        if cache is None and keeps_kv:
            cache = DynamicCache()
        ids = torch.tensor(seg.tokens[:n], device=device).unsqueeze(0)  # [1, n]
        positions = torch.arange(seg.depth, seg.depth + n, device=device).unsqueeze(0)  # [1, n]
        keep = torch.as_tensor(plan.keep[s], device=device)  # [k]
        out = module(
            input_ids=ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        )
        if seg.parent >= 0:
            waiting[seg.parent] -= 1
            if waiting[seg.parent] == 0:
                del kv[seg.parent]  # the autograd graph keeps what backward needs
        if keeps_kv:
            kv[s] = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        lo, hi = int(plan.pair_bounds[s]), int(plan.pair_bounds[s + 1])
        if hi > lo:
            logp_all = torch.log_softmax(_float_logits(out.logits[0]), dim=-1)  # [k, V]
            kept = torch.as_tensor(plan.pair_keep[lo:hi], device=device)  # [u]
            targets = torch.as_tensor(plan.pair_target[lo:hi], device=device)  # [u]
            pair_logp.append(logp_all[kept, targets])  # [u]
    return pair_logp


def tree_logprobs(
    model: nn.Module,
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
) -> Packed:
    """The rows as a prefix forest, each distinct token computed once; scored positions only."""
    num_rows, length = input_ids.shape
    lengths = attention_mask.sum(dim=1).tolist()  # [B]
    ids_np = input_ids.cpu().numpy()
    score_np = (score_mask.cpu() != 0).numpy()
    rows = [ids_np[b, : lengths[b]] for b in range(num_rows)]
    plan = plan_scores(rows, [score_np[b, : lengths[b]] for b in range(num_rows)])
    with prefix_attention(model):
        pair_logp = _run_tree(model, module, plan)

    device = input_ids.device
    param_dtype = next(model.parameters()).dtype
    dtype = pair_logp[0].dtype if pair_logp else torch.promote_types(param_dtype, torch.float32)
    flat = torch.zeros(num_rows * length, dtype=dtype, device=device)  # [B·T]
    if pair_logp:
        pairs = torch.cat(pair_logp)  # [U], in pair order (segments in preorder)
        entry_logp = pairs[torch.as_tensor(plan.entry_pair, device=device)]  # [E]
        where = torch.as_tensor(plan.entry_row * length + plan.entry_pos, device=device)  # [E]
        flat = flat.scatter(0, where, entry_logp)
    elif torch.is_grad_enabled():
        # Nothing scored (a micro-batch whose rows own nothing): a zero that still depends on
        # every parameter, so backward runs (and DDP's all-reduce sees every gradient).
        anchor = module(input_ids=input_ids[:1, :1], use_cache=False).logits.sum()
        flat = flat + 0.0 * anchor
    return Packed(flat.view(num_rows, length), plan.computed_tokens)


PACKINGS: dict[str, PackingFn] = {
    "padded": padded_logprobs,
    "tree": tree_logprobs,
}


def get_packing(name: str) -> PackingFn:
    try:
        return PACKINGS[name]
    except KeyError:
        known = ", ".join(sorted(PACKINGS))
        raise TrainerError(f"unknown packing {name!r} (known: {known})", param="packing") from None
