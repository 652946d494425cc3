"""The prefix forest and its scoring plan, on hand-built rows (no model)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_bridge.errors import TrainerError
from trainer_bridge.tree import build_forest, plan_scores


def _rows(*rows: list[int]) -> list[np.ndarray]:
    return [np.array(r, dtype=np.int64) for r in rows]


def test_shared_prefix_becomes_one_segment() -> None:
    #   row 0: 1 2 3 4 5        segments (preorder): [1 2 3] → [4 5], [6 7] ; [9]
    #   row 1: 1 2 3 6 7
    #   row 2: 9
    forest = build_forest(_rows([1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [9]))
    got = [(s.parent, s.depth, s.offset, s.tokens.tolist()) for s in forest.segments]
    assert got == [(-1, 0, 0, [1, 2, 3]), (0, 3, 3, [4, 5]), (0, 3, 5, [6, 7]), (-1, 0, 7, [9])]
    assert forest.paths == ((0, 1), (0, 2), (3,))
    assert forest.distinct_tokens == 3 + 2 + 2 + 1 == 8
    assert forest.row_tokens == 5 + 5 + 1 == 11
    assert forest.flat_index(1).tolist() == [0, 1, 2, 5, 6]


def test_a_row_that_is_a_prefix_of_another_ends_at_a_split() -> None:
    forest = build_forest(_rows([1, 2, 3, 4], [1, 2]))
    assert [s.tokens.tolist() for s in forest.segments] == [[1, 2], [3, 4]]
    assert forest.paths == ((0, 1), (0,))
    # Inserted the other way round, the same forest.
    again = build_forest(_rows([1, 2], [1, 2, 3, 4]))
    assert [s.tokens.tolist() for s in again.segments] == [[1, 2], [3, 4]]
    assert again.paths == ((0,), (0, 1))


def test_identical_rows_share_every_segment() -> None:
    forest = build_forest(_rows([5, 6, 7], [5, 6, 7]))
    assert len(forest.segments) == 1 and forest.paths == ((0,), (0,))


def test_an_empty_row_is_refused() -> None:
    with pytest.raises(TrainerError, match="without tokens"):
        build_forest(_rows([1], []))


def test_plan_reads_a_child_s_first_token_from_the_parent_s_last_position() -> None:
    # Segments: A = [1 2 3] (flat 0..2), B = [4 5] (flat 3..4), C = [6 7] (flat 5..6).
    rows = _rows([1, 2, 3, 4, 5], [1, 2, 3, 6, 7])
    score = [np.array([0, 0, 0, 1, 1], dtype=bool), np.array([0, 0, 0, 1, 0], dtype=bool)]
    plan = plan_scores(rows, score)
    # Entries: (row 0, t=3) predicted at flat 2 (A's last), (0, 4) at flat 3 (B's first),
    # (1, 3) at flat 2 again, with another target (6, not 4): three distinct pairs.
    assert plan.entry_row.tolist() == [0, 0, 1] and plan.entry_pos.tolist() == [3, 4, 3]
    assert plan.pair_target.tolist() == [4, 6, 5]  # sorted by predicting index, then target
    assert plan.entry_pair.tolist() == [0, 2, 1]
    assert plan.pair_bounds.tolist() == [0, 2, 3, 3]  # A: 2 pairs, B: 1, C: none
    assert [k.tolist() for k in plan.keep] == [[2], [0], []]
    # A runs whole (its children run), B up to its first token, C not at all: its first token
    # is read from A, and nothing reads C's logits.
    assert plan.run_length.tolist() == [3, 1, 0]
    assert plan.computed_tokens == 4
    assert plan.running_children().tolist() == [1, 0, 0]


def test_plan_shares_a_pair_owned_by_two_rows() -> None:
    # The same tokens in two rows (two episodes sampling the same answer): one logprob, two
    # entries — each row keeps its own loss term.
    rows = _rows([1, 2, 3], [1, 2, 3])
    score = [np.array([0, 1, 1], dtype=bool)] * 2
    plan = plan_scores(rows, score)
    assert plan.entry_pair.tolist() == [0, 1, 0, 1]
    assert plan.pair_target.tolist() == [2, 3]
    assert plan.computed_tokens == 2  # token 3 (last) predicts nothing


token_lists = st.lists(st.integers(1, 3), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=8))
def test_every_row_is_spelled_by_its_path(rows: list[list[int]]) -> None:
    forest = build_forest(_rows(*rows))
    flat = np.concatenate([s.tokens for s in forest.segments])
    for b, row in enumerate(rows):
        assert flat[forest.flat_index(b)].tolist() == row
        path = forest.paths[b]
        for upper, lower in itertools.pairwise(path):
            assert forest.segments[lower].parent == upper
            assert forest.segments[lower].depth == forest.segments[upper].depth + len(
                forest.segments[upper].tokens
            )
    # A forest of distinct prefixes: no two siblings start with the same token, and the
    # distinct tokens are the distinct non-empty prefixes of the rows.
    prefixes = {tuple(r[: i + 1]) for r in rows for i in range(len(r))}
    assert forest.distinct_tokens == len(prefixes)
    for s, seg in enumerate(forest.segments):
        assert seg.parent < s  # preorder
        siblings = [t for t in forest.segments if t.parent == seg.parent and t is not seg]
        assert all(int(t.tokens[0]) != int(seg.tokens[0]) for t in siblings)
