"""Hand-built training rows for the trainer tests."""

from __future__ import annotations

import random
from collections.abc import Sequence

from capture_contracts.rows import Row, Span


def make_row(
    row_id: str,
    episode_id: str,
    group_id: str,
    reward: float,
    input_ids: Sequence[int],
    owned: Sequence[tuple[int, int]] = (),
    *,
    unowned: Sequence[tuple[int, int]] = (),
    logprob: float = -1.0,
) -> Row:
    """A row whose ``owned`` [start, end) ranges carry loss; behaviour logprob ``logprob`` there."""
    n = len(input_ids)
    mask = [0] * n
    for start, end in owned:
        for i in range(start, end):
            mask[i] = 1
    spans = [Span(f"{row_id}/c{k}", s, e, True) for k, (s, e) in enumerate(owned)]
    spans += [Span(f"{row_id}/u{k}", s, e, False) for k, (s, e) in enumerate(unowned)]
    return Row(
        row_id=row_id,
        episode_id=episode_id,
        group_id=group_id,
        reward=reward,
        input_ids=tuple(input_ids),
        loss_mask=tuple(mask),
        behavior_logprobs=tuple(logprob if m else 0.0 for m in mask),
        spans=tuple(sorted(spans, key=lambda s: s.start)),
    )


def token_ids(n: int, *, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def simple_rows(num_episodes: int = 4, rows_per_episode: int = 2, *, seed: int = 0) -> list[Row]:
    """Two groups of episodes, several rows each, varied lengths and rewards."""
    rng = random.Random(seed)
    rows: list[Row] = []
    for e in range(num_episodes):
        for r in range(rows_per_episode):
            n = rng.randrange(8, 20)
            ids = token_ids(n, seed=seed * 1000 + e * 10 + r)
            start = rng.randrange(2, n - 3)
            rows.append(
                make_row(
                    f"ep{e}/{r}",
                    f"ep{e}",
                    f"g{e % 2}",
                    float(e),
                    ids,
                    [(start, n)],
                    logprob=-rng.uniform(4.0, 7.0),
                )
            )
    return rows
