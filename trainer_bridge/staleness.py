"""Staleness: how many policy versions lie between the policy that sampled a token and the learner.

Every trained token knows the version that sampled it (``TrainBatch.versions``, from the rows'
spans, from the calls' ``weight_version``). The learner's version is the one its current weights
would be published as. Staleness of a token = learner version − sampling version (≥ 0; tokens of
unknown version count as fresh and are reported as ``unknown_tokens``).

Above ``max_staleness`` a token is either dropped (out of ``loss_mask``: no loss, not counted in
the global token mean) or down-weighted (its advantage times ``1 / (1 + staleness −
max_staleness)``); ``StalenessPolicy`` names which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from trainer_bridge.batch import TrainBatch
from trainer_bridge.errors import TrainerError

StalenessPolicy = Literal["drop", "downweight"]


@dataclass(frozen=True, slots=True)
class StalenessStats:
    mean: float  # over trained tokens of known version
    max: int
    unknown_tokens: int  # trained tokens without a recorded version
    stale_tokens: int  # trained tokens above the limit (dropped or down-weighted)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def token_staleness(batch: TrainBatch, learner_version: int) -> torch.Tensor:
    """``[B, T]`` int64: learner version − sampling version on trained tokens, 0 elsewhere."""
    if batch.versions is None:
        return torch.zeros_like(batch.input_ids)
    known = (batch.versions >= 0) & (batch.loss_mask > 0)  # [B, T]
    staleness = (learner_version - batch.versions).clamp(min=0)  # [B, T]
    return torch.where(known, staleness, torch.zeros_like(staleness))


def staleness_stats(
    batch: TrainBatch, learner_version: int, max_staleness: int | None = None
) -> StalenessStats:
    trained = batch.loss_mask > 0  # [B, T]
    if batch.versions is None:
        return StalenessStats(0.0, 0, int(trained.sum().item()), 0)
    known = trained & (batch.versions >= 0)  # [B, T]
    staleness = token_staleness(batch, learner_version)  # [B, T]
    count = int(known.sum().item())
    stale = 0 if max_staleness is None else int((known & (staleness > max_staleness)).sum())
    return StalenessStats(
        mean=float(staleness[known].double().mean().item()) if count else 0.0,
        max=int(staleness.max().item()) if count else 0,
        unknown_tokens=int((trained & ~known).sum().item()),
        stale_tokens=stale,
    )


def limit_staleness(
    batch: TrainBatch,
    learner_version: int,
    max_staleness: int | None,
    policy: StalenessPolicy = "drop",
) -> TrainBatch:
    """The batch with tokens above ``max_staleness`` dropped or down-weighted (needs advantages)."""
    if max_staleness is None:
        return batch
    if max_staleness < 0:
        raise TrainerError(f"max_staleness must be >= 0, got {max_staleness}")
    if batch.advantages is None:
        raise TrainerError("limit_staleness needs advantages: call grpo.with_advantages first")
    staleness = token_staleness(batch, learner_version)  # [B, T]
    over = staleness > max_staleness  # [B, T]
    if policy == "drop":
        keep = (~over).to(batch.loss_mask.dtype)  # [B, T]
        return dataclasses.replace(
            batch,
            loss_mask=batch.loss_mask * keep,
            advantages=batch.advantages * keep,
            behavior_logprobs=batch.behavior_logprobs * keep,
        )
    if policy == "downweight":
        excess = (staleness - max_staleness).clamp(min=0).to(torch.float32)  # [B, T]
        weight = 1.0 / (1.0 + excess)  # [B, T], 1 up to the limit
        return dataclasses.replace(batch, advantages=batch.advantages * weight)
    raise TrainerError(f"unknown staleness policy {policy!r} (known: drop, downweight)")
