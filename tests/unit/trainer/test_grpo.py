"""GRPO over logical rollouts: hand-computed advantages (DESIGN §6)."""

from __future__ import annotations

import math

import pytest
import torch

from capture_contracts.rows import Row
from tests.support.rowkit import make_row, token_ids
from trainer_bridge.batch import collate
from trainer_bridge.errors import InconsistentRows, TrainerError
from trainer_bridge.grpo import episode_advantages, episode_rewards, with_advantages


def _episode_rows(episode_id: str, group_id: str, reward: float, num_rows: int) -> list[Row]:
    return [
        make_row(
            f"{episode_id}/{r}",
            episode_id,
            group_id,
            reward,
            token_ids(6 + r, seed=sum(map(ord, episode_id)) * 10 + r),
            [(2, 4), (5, 6 + r)],
        )
        for r in range(num_rows)
    ]


def _advantage_by_episode(rows: list[Row], *, normalize_std: bool = False) -> dict[str, float]:
    """Every owned token of an episode's rows must carry one value; return it per episode."""
    batch = with_advantages(collate(rows), normalize_std=normalize_std)
    assert batch.advantages is not None
    found: dict[str, set[float]] = {}
    for b in range(batch.num_rows):
        episode = batch.episode_ids[int(batch.episode_index[b])]
        owned = batch.loss_mask[b] == 1
        assert torch.all(batch.advantages[b][~owned] == 0.0)
        found.setdefault(episode, set()).update(batch.advantages[b][owned].tolist())
    assert all(len(values) == 1 for values in found.values()), found
    return {episode: values.pop() for episode, values in found.items()}


def test_rows_per_episode_do_not_change_the_advantages() -> None:
    # Rewards 1.0, 0.0, 0.5 → group mean (1.0 + 0.0 + 0.5) / 3 = 0.5 (one vote per episode)
    # → advantages +0.5, −0.5, 0.0. Had the baseline counted rows (1, 2 and 5 of them) it would
    # be (1.0·1 + 0.0·2 + 0.5·5) / 8 = 0.4375.
    uneven = (
        _episode_rows("a", "task", 1.0, 1)
        + _episode_rows("b", "task", 0.0, 2)
        + _episode_rows("c", "task", 0.5, 5)
    )
    one_each = (
        _episode_rows("a", "task", 1.0, 1)
        + _episode_rows("b", "task", 0.0, 1)
        + _episode_rows("c", "task", 0.5, 1)
    )
    expected = {"a": 0.5, "b": -0.5, "c": 0.0}
    assert _advantage_by_episode(uneven) == pytest.approx(expected, abs=1e-7)
    assert _advantage_by_episode(one_each) == pytest.approx(expected, abs=1e-7)
    assert _advantage_by_episode(uneven) == _advantage_by_episode(one_each)


def test_normalize_std_uses_the_episode_rewards() -> None:
    # Population std of (1.0, 0.0, 0.5) around 0.5: sqrt((0.25 + 0.25 + 0) / 3) = sqrt(1/6)
    # → a: 0.5 / sqrt(1/6) = sqrt(1.5) ≈ 1.2247, b: −1.2247, c: 0.
    rows = (
        _episode_rows("a", "task", 1.0, 1)
        + _episode_rows("b", "task", 0.0, 2)
        + _episode_rows("c", "task", 0.5, 5)
    )
    got = _advantage_by_episode(rows, normalize_std=True)
    assert got == pytest.approx({"a": math.sqrt(1.5), "b": -math.sqrt(1.5), "c": 0.0}, rel=1e-5)


def test_groups_are_independent() -> None:
    # Group x: rewards 3, 1 → mean 2 → +1, −1. Group y: rewards 0, 0, 6 → mean 2 → −2, −2, +4.
    rows = (
        _episode_rows("x1", "x", 3.0, 2)
        + _episode_rows("x2", "x", 1.0, 1)
        + _episode_rows("y1", "y", 0.0, 1)
        + _episode_rows("y2", "y", 0.0, 3)
        + _episode_rows("y3", "y", 6.0, 1)
    )
    expected = {"x1": 1.0, "x2": -1.0, "y1": -2.0, "y2": -2.0, "y3": 4.0}
    assert _advantage_by_episode(rows) == pytest.approx(expected)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_single_episode_and_zero_variance_groups_give_zero(normalize_std: bool) -> None:
    rows = (
        _episode_rows("alone", "solo", 7.0, 3)
        + _episode_rows("s1", "same", 1.0, 2)
        + _episode_rows("s2", "same", 1.0, 1)
    )
    got = _advantage_by_episode(rows, normalize_std=normalize_std)
    assert got == {"alone": 0.0, "s1": 0.0, "s2": 0.0}


def test_episode_advantages_table() -> None:
    episodes = episode_rewards([("e1", "g", 2.0), ("e1", "g", 2.0), ("e2", "g", 0.0)])
    assert list(episodes) == ["e1", "e2"]
    assert episode_advantages(episodes) == {"e1": 1.0, "e2": -1.0}


def test_rows_of_one_episode_with_two_rewards_are_rejected() -> None:
    odd = make_row("e1/9", "e1", "g", 0.0, token_ids(6, seed=1), [(3, 6)])
    rows = [*_episode_rows("e1", "g", 1.0, 1), odd]
    with pytest.raises(InconsistentRows, match=r"episode 'e1' has rows with two rewards"):
        with_advantages(collate(rows))


def test_rows_of_one_episode_in_two_groups_are_rejected() -> None:
    odd = make_row("e1/9", "e1", "h", 1.0, token_ids(6, seed=1), [(3, 6)])
    rows = [*_episode_rows("e1", "g", 1.0, 1), odd]
    with pytest.raises(InconsistentRows, match=r"episode 'e1' has rows in two groups"):
        with_advantages(collate(rows))
    assert issubclass(InconsistentRows, TrainerError)
