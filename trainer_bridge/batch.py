"""Rows → one frozen batch of right-padded tensors.

Order: rows are sorted by ``row_id`` (plain string order), so a batch does not depend on the order
in which a reader or a Ray Data shard delivered them. Episodes and groups are numbered in order of
first appearance in that sorted order (``episode_index``, ``group_index``).

Padding is on the right with ``pad_id``: under causal attention a real position never attends to
a later pad, so padding changes no real position's logits. Padded positions have
``attention_mask == 0``, ``loss_mask == 0`` and ``behavior_logprobs == 0``.

Grammar-constrained tokens (a span with ``constrained``: the engine sampled them from the logits
masked by a grammar, and their behaviour logprobs are of that masked distribution) are not
actions of the policy: with ``constrained="exclude"`` (the default) they are owned by their row
but kept out of ``loss_mask``, so they enter neither the ratio, the loss, nor the token count;
``"include"`` trains them like sampled tokens (their ratio is then off-policy by the mask).
``versions`` holds each position's sampling policy version (-1 where unknown or unowned).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from capture_contracts.rows import Row
from trainer_bridge.errors import TrainerError

ConstrainedTokens = Literal["exclude", "include"]


@dataclass(frozen=True)
class TrainBatch:
    """B rows padded to length T. ``advantages`` is set by ``grpo.with_advantages``."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] float32, 1 on owned tokens
    behavior_logprobs: torch.Tensor  # [B, T] float32, 0 off owned tokens
    rewards: torch.Tensor  # [B] float64, the reward of each row's episode
    episode_index: torch.Tensor  # [B] int64 into episode_ids
    group_index: torch.Tensor  # [B] int64 into group_ids
    row_ids: tuple[str, ...]
    episode_ids: tuple[str, ...]
    group_ids: tuple[str, ...]
    advantages: torch.Tensor | None = None  # [B, T] float32, 0 off owned tokens
    versions: torch.Tensor | None = None  # [B, T] int64 sampling policy version, -1 unknown
    constrained_tokens: int = 0  # owned tokens kept out of loss_mask (grammar-constrained)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ids)

    @property
    def row_tokens(self) -> int:
        """Real (unpadded) tokens of the rows."""
        return int(self.attention_mask.sum().item())

    @property
    def owned_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def select(self, index: slice | Sequence[int]) -> TrainBatch:
        """The sub-batch of the given rows, trimmed to its longest row.

        Episode and group numbering is kept (indices still point into the full id tuples), so a
        micro-batch or a shard is a view of the same batch, not a new one.
        """
        idx = (
            torch.arange(self.num_rows)[index]
            if isinstance(index, slice)
            else torch.as_tensor(list(index), dtype=torch.long)
        )
        if idx.numel() == 0:
            raise TrainerError("cannot select an empty sub-batch")
        length = int(self.attention_mask[idx].sum(dim=1).max().item())
        advantages = None if self.advantages is None else self.advantages[idx, :length]
        versions = None if self.versions is None else self.versions[idx, :length]
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[idx, :length],
            attention_mask=self.attention_mask[idx, :length],
            loss_mask=self.loss_mask[idx, :length],
            behavior_logprobs=self.behavior_logprobs[idx, :length],
            rewards=self.rewards[idx],
            episode_index=self.episode_index[idx],
            group_index=self.group_index[idx],
            row_ids=tuple(self.row_ids[i] for i in idx.tolist()),
            advantages=advantages,
            versions=versions,
        )

    def micro_batches(self, size: int | None) -> list[TrainBatch]:
        """Consecutive sub-batches of at most ``size`` rows (``None``: the whole batch)."""
        if size is None or size >= self.num_rows:
            return [self]
        if size < 1:
            raise TrainerError(f"micro-batch size must be positive, got {size}")
        return [self.select(slice(i, i + size)) for i in range(0, self.num_rows, size)]


def _reward(row: Row) -> float:
    if row.reward is None:
        raise TrainerError(
            f"row {row.row_id!r} has no reward (an episode needs a reward before its rows can be "
            "trained)",
            param="reward",
        )
    return row.reward


def collate(
    rows: Sequence[Row], *, pad_id: int = 0, constrained: ConstrainedTokens = "exclude"
) -> TrainBatch:
    """Sort rows by ``row_id`` and pad them into a ``TrainBatch`` (no advantages yet)."""
    if constrained not in ("exclude", "include"):
        raise TrainerError(f"constrained must be exclude or include, got {constrained!r}")
    if not rows:
        raise TrainerError("no rows to batch", param="rows")
    ordered = sorted(rows, key=lambda r: r.row_id)
    duplicates = {a.row_id for a, b in itertools.pairwise(ordered) if a.row_id == b.row_id}
    if duplicates:
        raise TrainerError(f"duplicate row_id(s): {', '.join(sorted(duplicates))}", param="rows")

    num_rows = len(ordered)
    max_len = max(len(r.input_ids) for r in ordered)
    episode_ids: dict[str, int] = {}
    group_ids: dict[str, int] = {}

    input_ids = torch.full((num_rows, max_len), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((num_rows, max_len), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((num_rows, max_len), dtype=torch.float32)  # [B, T]
    behavior_logprobs = torch.zeros((num_rows, max_len), dtype=torch.float32)  # [B, T]
    versions = torch.full((num_rows, max_len), -1, dtype=torch.long)  # [B, T]
    excluded = 0
    episode_index = torch.empty(num_rows, dtype=torch.long)  # [B]
    group_index = torch.empty(num_rows, dtype=torch.long)  # [B]
    for b, row in enumerate(ordered):
        n = len(row.input_ids)
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        mask = torch.tensor(row.loss_mask, dtype=torch.float32)  # [n]
        row_constrained, row_versions = row.position_masks()
        if constrained == "exclude" and row_constrained.any():
            forced = torch.from_numpy(row_constrained).to(torch.float32) * mask  # [n]
            excluded += int(forced.sum().item())
            mask = mask - forced
        versions[b, :n] = torch.from_numpy(row_versions) * mask.long() - (1 - mask.long())
        loss_mask[b, :n] = mask
        # Only owned positions carry a behaviour logprob; anything else is forced to 0.
        behavior_logprobs[b, :n] = torch.tensor(row.behavior_logprobs, dtype=torch.float32) * mask
        episode_index[b] = episode_ids.setdefault(row.episode_id, len(episode_ids))
        group_index[b] = group_ids.setdefault(row.group_id, len(group_ids))

    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior_logprobs,
        rewards=torch.tensor([_reward(r) for r in ordered], dtype=torch.float64),
        episode_index=episode_index,
        group_index=group_index,
        row_ids=tuple(r.row_id for r in ordered),
        episode_ids=tuple(episode_ids),
        group_ids=tuple(group_ids),
        versions=versions,
        constrained_tokens=excluded,
    )
