"""Golden corpus: each file's rows and accounting must be reproduced exactly, and each case is also
pinned by facts derived by hand from its construction (tests/golden/make_golden.py): row count,
which calls each row owns (in walk order), owned-token counts, classes and notes.

Arithmetic: completions are 3 tokens unless noted, so a row owning k generations has mask sum 3k.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reconstruct import parse_bundle, reconstruct_episode
from reconstruct.invariants import invariant_violations
from tests.golden.make_golden import SCENARIOS

GOLDEN = Path(__file__).parents[2] / "golden"

# case → (owned call ids per row in row order, mask sum per row, non-zero class counts)
HAND: dict[str, tuple[list[list[str]], list[int], dict[str, int]]] = {
    "linear_chain": ([["a1", "a2", "a3", "a4"]], [12], {"trained": 4}),
    # a1 admitted before b1: a's root walks first
    "interleaved_roots": ([["a1", "a2"], ["b1", "b2"]], [6, 6], {"trained": 4}),
    # one root p; endpoints by completion: y (seq 5) before x (seq 6) → y's row owns p
    "shared_prefix_fork": ([["p", "y"], ["x"]], [6, 3], {"trained": 3}),
    # p1 admitted first (its tree walks first), then w1-1, w2-1 (roots by admission)
    "parent_workers_resume": (
        [["p1", "p2"], ["w1-1", "w1-2"], ["w2-1", "w2-2"]],
        [6, 6, 6],
        {"trained": 6},
    ),
    # endpoints b (seq 6), c (8), d (10): b's row owns p, c's owns a
    "nested_forks": ([["p", "b"], ["a", "c"], ["d"]], [6, 6, 3], {"trained": 5}),
    # compaction is trainable and continues w2: one row w1,w2,wc; the rewrite w3 is a new root
    "compaction_in_worker": (
        [["p1", "p2"], ["w1", "w2", "wc"], ["w3", "w4"]],
        [6, 9, 6],
        {"trained": 7},
    ),
    "retried_call": ([["a1", "a2r", "a3"]], [9], {"trained": 3, "discarded_retry": 1}),
    # a3 discarded first (a2b's parent a1 is above a3's parent a2), then a2 (same parent)
    "same_agent_rollback": ([["a1", "a2b"]], [6], {"trained": 2, "discarded_retry": 2}),
    "harness_marked_discard": ([["a1", "a2"]], [6], {"trained": 2, "discarded_retry": 1}),
    "harness_marked_accept": ([["a1", "a2"], ["a2b"]], [6, 3], {"trained": 3}),
    # t: root, no descendants → its row owns nothing, not emitted; x conditions y
    "auxiliary_calls": ([["a1", "a2"], ["y"]], [6, 3], {"trained": 3, "conditioning_only": 2}),
    # t (unlabelled auxiliary leaf) completes before p2: its row is walked first and owns p1
    "auxiliary_fork_leaf": ([["p1"], ["p2"]], [3, 3], {"trained": 2, "conditioning_only": 1}),
    "failed_and_cancelled": (
        [["a1", "a2"]],
        [6],
        {"trained": 2, "failed": 1, "cancelled": 1},
    ),
    # c-1 completes first
    "n2_siblings": ([["p", "c-1"], ["c-0"]], [6, 3], {"trained": 3}),
    # two roots s0 (admitted first), s1; c's parent is s1 (latest completed)
    "ambiguous_tie": ([["s0"], ["s1", "c"]], [3, 6], {"trained": 3}),
    "chain20_compaction": (
        [[f"t{i:02d}" for i in range(1, 11)] + ["compact"], [f"t{i:02d}" for i in range(12, 21)]],
        [33, 27],
        {"trained": 20},
    ),
}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))
    return data


def test_every_scenario_has_a_file_and_hand_facts() -> None:
    files = {p.stem for p in GOLDEN.glob("*.json")}
    assert files == set(SCENARIOS) == set(HAND)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_file_is_current(name: str) -> None:
    assert _load(name)["bundle"] == SCENARIOS[name](), (
        "regenerate: python -m tests.golden.make_golden"
    )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_rows_and_accounting(name: str) -> None:
    case = _load(name)
    result = reconstruct_episode(case["bundle"])
    assert [row.to_dict() for row in result.rows] == case["expected"]["rows"]
    assert result.accounting.to_dict() == case["expected"]["accounting"]
    assert invariant_violations(parse_bundle(case["bundle"]), result) == []


@pytest.mark.parametrize("name", sorted(HAND))
def test_golden_hand_facts(name: str) -> None:
    owners, mask_sums, counts = HAND[name]
    case = _load(name)
    result = reconstruct_episode(case["bundle"])
    assert len(result.rows) == len(owners)
    assert [[s.call_id for s in row.spans if s.owned] for row in result.rows] == owners
    assert [int(row.loss_mask.sum()) for row in result.rows] == mask_sums
    assert {k: v for k, v in result.accounting.counts.items() if v} == counts
    assert [row.row_id for row in result.rows] == [
        f"{case['bundle']['episode_id']}/{i}" for i in range(len(owners))
    ]
    for row, expected in zip(case["expected"]["rows"], result.rows, strict=True):
        assert row["reward"] == 1.0 and expected.group_id == "task"


def _row(name: str, index: int) -> dict[str, Any]:
    row: dict[str, Any] = _load(name)["expected"]["rows"][index]
    return row


def test_linear_chain_layout_by_hand() -> None:
    # prompt 4, then (3 generated + 2 appended) × 3, then 3 generated: 4 + 5·3 + 3 = 22 tokens
    row = _row("linear_chain", 0)
    assert row["input_ids"] == list(range(10, 32))
    owned = [i for i, m in enumerate(row["loss_mask"]) if m]
    assert owned == [4, 5, 6, 9, 10, 11, 14, 15, 16, 19, 20, 21]
    assert [(s["start"], s["end"]) for s in row["spans"]] == [(4, 7), (9, 12), (14, 17), (19, 22)]
    assert all(
        lp == 0.0 for lp, m in zip(row["behavior_logprobs"], row["loss_mask"], strict=True) if not m
    )
    assert all(
        lp < 0.0 for lp, m in zip(row["behavior_logprobs"], row["loss_mask"], strict=True) if m
    )


def test_worker_answers_in_parent_prompt_are_masked() -> None:
    # p1: prompt 4 + 3 = 7; p2 prompt = 7 + 1 + 3 (w1 answer) + 3 (w2 answer) + 1 = 15; full 18
    case = _load("parent_workers_resume")
    calls = {c["call_id"]: c for c in case["bundle"]["calls"]}
    row = case["expected"]["rows"][0]
    assert len(row["input_ids"]) == 18
    assert row["input_ids"][8:11] == calls["w1-2"]["completion_token_ids"]
    assert row["input_ids"][11:14] == calls["w2-2"]["completion_token_ids"]
    assert [i for i, m in enumerate(row["loss_mask"]) if m] == [4, 5, 6, 15, 16, 17]


def test_shared_prefix_fork_second_row_repeats_p_unowned() -> None:
    row = _row("shared_prefix_fork", 1)
    assert [(s["call_id"], s["start"], s["end"], s["owned"]) for s in row["spans"]] == [
        ("p", 4, 7, False),
        ("x", 9, 12, True),
    ]


def test_marks_and_ties_are_reported() -> None:
    marks = reconstruct_episode(_load("harness_marked_accept")["bundle"]).accounting
    assert [(n.call_id, n.reason) for n in marks.ineffective_marks] == [
        ("a1", "has_kept_descendants"),
        ("a2b", "nothing_to_override"),
    ]
    discard = reconstruct_episode(_load("harness_marked_discard")["bundle"]).accounting
    assert [(n.call_id, n.reason) for n in discard.ineffective_marks] == [
        ("a1", "has_kept_descendants")
    ]
    assert discard.classification["a3"] == "discarded_retry"
    tie = reconstruct_episode(_load("ambiguous_tie")["bundle"])
    assert tie.accounting.ambiguous_parent == ("c",)
    assert tie.parents["c"] == "s1"


def test_chain20_token_figures() -> None:
    # part 1: 4 + 10·3 + 9·2 = 52 tokens, then the compaction prompt adds 2 and it generates 3: 57.
    # part 2: 2 + 3 (summary) then 9 calls: 5 + 9·3 + 8·2 = 48.
    acc = reconstruct_episode(_load("chain20_compaction")["bundle"]).accounting
    assert acc.rows == 2
    assert acc.row_tokens == 57 + 48
    assert acc.owned_tokens == 60
    assert np.sum([1 for v in acc.classification.values() if v == "trained"]) == 20
