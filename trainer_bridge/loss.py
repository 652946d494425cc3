"""Token-level policy-gradient losses: tensors in, a loss and a small stats tuple out.

Every loss is a *sum* over owned tokens divided by ``num_tokens``, the number of owned tokens in
the whole batch (all micro-batches, all ranks). Passing the global count explicitly makes the loss
additive: the sum of the micro-batch losses is the full-batch loss, so gradient accumulation and
data parallelism give the update of one big batch, and the row layout (merged rows vs one row per
call) cannot change it. The stats are normalised the same way and add up the same way.

Variants live in ``LOSSES`` (name → per-token function); ``policy_loss`` does the masking,
normalisation, optional KL-to-reference and stats common to all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainer_bridge.errors import TrainerError


@dataclass(frozen=True, slots=True)
class LossConfig:
    name: str = "clipped_pg"
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # weight of the KL-to-reference term; 0 = off


class LossStats(NamedTuple):
    """Token sums divided by the global owned-token count: add them over micro-batches/ranks."""

    clip_fraction: torch.Tensor  # share of owned tokens whose clipped branch is active
    approx_kl: torch.Tensor  # k3 estimate of KL(behaviour ‖ current): (r − 1) − log r
    mean_ratio: torch.Tensor  # mean importance ratio r = exp(logp − behaviour_logp)


class TokenLoss(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token loss (before masking)
    clipped: torch.Tensor  # [B, T] bool, the clip is active at this token


TokenLossFn = Callable[[torch.Tensor, torch.Tensor, LossConfig], TokenLoss]


def clipped_pg(ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    """PPO's clipped surrogate: max(−A·r, −A·clip(r, 1 − ε, 1 + ε))."""
    unclipped = -advantages * ratio  # [B, T]
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)  # [B, T]
    clipped = -advantages * clipped_ratio  # [B, T]
    pg_loss = torch.maximum(unclipped, clipped)  # [B, T]
    is_clipped = ((ratio > 1.0 + cfg.clip_eps) & (advantages > 0)) | (
        (ratio < 1.0 - cfg.clip_eps) & (advantages < 0)
    )
    return TokenLoss(pg_loss, is_clipped)


def importance_pg(ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    """Unclipped importance-weighted policy gradient: −A·r (on-policy: plain REINFORCE)."""
    return TokenLoss(-advantages * ratio, torch.zeros_like(ratio, dtype=torch.bool))


LOSSES: dict[str, TokenLossFn] = {
    "clipped_pg": clipped_pg,
    "importance_pg": importance_pg,
}


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_tokens: int,
    cfg: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Σ_owned token_loss / num_tokens (+ kl_coef · Σ_owned KL(π ‖ π_ref) / num_tokens).

    All tensors are ``[B, T]``; ``loss_mask`` is 1 on owned tokens. ``num_tokens`` is the owned
    token count of the *whole* batch, not of this slice.
    """
    if num_tokens <= 0:
        raise TrainerError("the batch owns no tokens: nothing to train", param="loss_mask")
    try:
        token_loss_fn = LOSSES[cfg.name]
    except KeyError:
        known = ", ".join(sorted(LOSSES))
        raise TrainerError(f"unknown loss {cfg.name!r} (known: {known})", param="loss") from None

    mask = loss_mask.to(logprobs.dtype)  # [B, T]
    log_ratio = (logprobs - behavior_logprobs) * mask  # [B, T], 0 off owned tokens
    ratio = torch.exp(log_ratio)  # [B, T]
    token = token_loss_fn(ratio, advantages, cfg)
    loss = (token.loss * mask).sum() / num_tokens

    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise TrainerError("kl_coef is set but no reference logprobs were given")
        ref_log_ratio = (ref_logprobs - logprobs) * mask  # [B, T]
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0  # [B, T], k3 estimate of KL(π‖ref)
        loss = loss + cfg.kl_coef * (kl * mask).sum() / num_tokens

    with torch.no_grad():
        stats = LossStats(
            clip_fraction=(token.clipped.to(mask.dtype) * mask).sum() / num_tokens,
            approx_kl=(((ratio - 1.0) - log_ratio) * mask).sum() / num_tokens,
            mean_ratio=(ratio * mask).sum() / num_tokens,
        )
    return loss, stats
