"""Grammar-constrained tokens and staleness in the batch (trainer_bridge/batch.py, staleness.py).

Row: 12 tokens; call c0 owns [3, 7) and was forced by a regex (version 4), call c1 owns [9, 12),
sampled freely (version 6). Hand-checked: excluding c0 leaves 3 trained tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from capture_contracts.rows import Row, Span
from trainer_bridge.batch import collate
from trainer_bridge.errors import TrainerError
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import LearnerConfig
from trainer_bridge.loss import policy_loss
from trainer_bridge.staleness import limit_staleness, staleness_stats, token_staleness

pytestmark = pytest.mark.unit


def _row(row_id: str, episode: str, reward: float) -> Row:
    mask = [0] * 12
    for i in (*range(3, 7), *range(9, 12)):
        mask[i] = 1
    return Row(
        row_id=row_id,
        episode_id=episode,
        group_id="g",
        reward=reward,
        input_ids=list(range(1, 13)),
        loss_mask=mask,
        # The engine's logprobs: the forced tokens' are of the grammar-masked distribution (0:
        # the mask left one choice), the free tokens' of the policy (-0.5).
        behavior_logprobs=[0.0 if 3 <= i < 7 else -0.5 * m for i, m in enumerate(mask)],
        spans=(
            Span(f"{row_id}/c0", 3, 7, True, weight_version=4, constrained=True),
            Span(f"{row_id}/c1", 9, 12, True, weight_version=6),
        ),
    )


ROWS = [_row("a/0", "a", 1.0), _row("b/0", "b", 0.0)]


def test_constrained_tokens_are_kept_out_of_the_loss_mask() -> None:
    batch = collate(ROWS)
    assert batch.constrained_tokens == 2 * 4
    assert batch.owned_tokens == 2 * 3
    assert batch.loss_mask[0].tolist() == [0] * 9 + [1] * 3
    assert batch.behavior_logprobs[0, 3:7].tolist() == [0.0] * 4  # not trained, not compared
    assert batch.versions is not None
    assert batch.versions[0].tolist() == [-1] * 9 + [6] * 3  # versions of trained tokens only


def test_include_trains_them_like_sampled_tokens() -> None:
    batch = collate(ROWS, constrained="include")
    assert (batch.constrained_tokens, batch.owned_tokens) == (0, 14)
    assert batch.versions is not None
    assert batch.versions[0, 3:7].tolist() == [4] * 4
    with pytest.raises(TrainerError):
        collate(ROWS, constrained="maybe")  # type: ignore[arg-type]


def test_masked_logprobs_no_longer_pull_the_ratio() -> None:
    """The learner scores every token unmasked (-0.5 here, what the free tokens were sampled
    with). Kept out, the constrained tokens leave the ratio at exactly 1; trained, each of them
    contributes exp(-0.5 - 0) and the mean ratio is (3 + 4 e^-0.5) / 7 ≈ 0.775."""
    learner = torch.full((2, 12), -0.5)  # [B, T]
    for constrained, expected in (("exclude", 1.0), ("include", (3 + 4 * 0.6065307) / 7)):
        batch = with_advantages(collate(ROWS, constrained=constrained))  # type: ignore[arg-type]
        assert batch.advantages is not None
        _, stats = policy_loss(
            learner,
            batch.behavior_logprobs,
            batch.advantages,
            batch.loss_mask,
            num_tokens=batch.owned_tokens,
        )
        assert float(stats.mean_ratio) == pytest.approx(expected, abs=1e-6)


def test_staleness_is_learner_version_minus_sampling_version() -> None:
    batch = with_advantages(collate(ROWS))
    assert token_staleness(batch, 9)[0].tolist() == [0] * 9 + [3] * 3
    stats = staleness_stats(batch, 9, max_staleness=2)
    assert (stats.mean, stats.max, stats.unknown_tokens, stats.stale_tokens) == (3.0, 3, 0, 6)
    assert staleness_stats(batch, 6).max == 0


def test_drop_and_downweight_above_the_limit() -> None:
    batch = with_advantages(collate(ROWS))
    assert batch.advantages is not None
    kept = limit_staleness(batch, 8, max_staleness=2)  # staleness 2: at the limit, kept
    assert kept.owned_tokens == batch.owned_tokens
    dropped = limit_staleness(batch, 9, max_staleness=2)  # staleness 3: dropped
    assert dropped.owned_tokens == 0
    assert dropped.advantages is not None and float(dropped.advantages.abs().sum()) == 0.0
    weighted = limit_staleness(batch, 10, max_staleness=2, policy="downweight")  # 4: 1/(1+2)
    assert weighted.advantages is not None
    assert torch.allclose(weighted.advantages, batch.advantages / 3.0)
    assert limit_staleness(batch, 10, None) is batch
    with pytest.raises(TrainerError):
        limit_staleness(batch, 10, -1)


def test_step_stats_count_the_excluded_tokens(tiny_model_dir: Path) -> None:
    from trainer_bridge.learner import Learner

    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-3))
    stats = learner.step(with_advantages(collate(ROWS)))
    assert (stats.owned_tokens, stats.constrained_tokens) == (6, 8)
