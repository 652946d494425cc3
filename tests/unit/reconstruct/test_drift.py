"""The drift report in the accounting: continued vs fresh contexts, stitched vs fresh renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_contracts.bundle import SCHEMA, ContinuationRecord, parse_continuation
from capture_contracts.drift import CallDrift, drift_report
from capture_contracts.errors import InvalidBundle
from reconstruct import reconstruct_episode


def _call(
    call_id: str, seq: int, prompt: list[int], completion: list[int], **extra: Any
) -> dict[str, Any]:
    return {
        "call_id": call_id,
        "agent_id": "a",
        "parent_agent_id": None,
        "role": extra.pop("role", "policy"),
        "status": "completed",
        "mark": None,
        "admitted_seq": seq,
        "completed_seq": seq + 1,
        "finish_reason": "stop",
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [-1.0] * len(completion),
        **extra,
    }


def _bundle(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "episode_id": "ep",
        "group_id": "g",
        "status": "closed",
        "reward": 1.0,
        "calls": calls,
    }


def test_drift_counts_stitched_calls_and_fresh_contexts() -> None:
    fresh = {"stitched": False, "reason": "no_previous_call", "base_call_id": None}
    calls = [
        _call("c1", 1, [1, 2], [3], continuation=fresh),
        _call("c2", 3, [1, 2, 3, 9], [4], continuation={"stitched": True, "base_call_id": "c1"}),
        _call(
            "c3", 5, [1, 2, 3, 9, 4, 9], [5], continuation={"stitched": True, "base_call_id": "c2"}
        ),
        # a compaction rewrite: a new root, rendered fresh
        _call(
            "c4", 7, [7, 7], [8], continuation={"stitched": False, "reason": "compaction_rewrite"}
        ),
        _call("c5", 9, [6], [6]),  # no record (a completions call, or an older proxy)
    ]
    drift = reconstruct_episode(_bundle(calls)).accounting.drift
    # c2, c3 continue exact tokens; c1, c4, c5 start contexts
    assert (drift.continued, drift.fresh_contexts) == (2, 3)
    assert drift.stitched == 2
    assert drift.fresh_renders == {"no_previous_call": 1, "compaction_rewrite": 1}
    assert reconstruct_episode(_bundle(calls)).accounting.to_dict()["drift"] == {
        "continued": 2,
        "fresh_contexts": 3,
        "stitched": 2,
        "fresh_renders": {"compaction_rewrite": 1, "no_previous_call": 1},
    }


def test_a_malformed_continuation_record_is_rejected() -> None:
    bad = _call("c1", 1, [1], [2], continuation={"stitched": "yes"})
    with pytest.raises(InvalidBundle, match="continuation"):
        reconstruct_episode(_bundle([bad]))


def test_golden_linear_chain_continues_and_compaction_restarts() -> None:
    golden = Path(__file__).parents[2] / "golden"
    linear = json.loads((golden / "linear_chain.json").read_text())["bundle"]
    drift = reconstruct_episode(linear).accounting.drift
    assert (drift.continued, drift.fresh_contexts) == (3, 1)  # 4 calls, one context
    chain = json.loads((golden / "chain20_compaction.json").read_text())["bundle"]
    drift = reconstruct_episode(chain).accounting.drift
    assert (drift.continued, drift.fresh_contexts) == (18, 2)  # 20 calls, one compaction rewrite


def test_a_continuation_record_round_trips_with_its_render_marks() -> None:
    record = ContinuationRecord(
        stitched=True,
        base_call_id="c1",
        mode="stitch",
        base_len=4,
        suffix_len=3,
        renders=1,
        render_len=6,
        render_digest="ab" * 16,
    )
    assert parse_continuation(record.to_dict(), "call c2") == record
    older = {"stitched": True, "base_call_id": "c1"}  # a record from before renders were kept
    assert parse_continuation(older, "call c2") == ContinuationRecord(True, base_call_id="c1")
    with pytest.raises(InvalidBundle, match="render_len"):
        parse_continuation(older | {"render_len": "six"}, "call c2")


def test_the_proxy_report_counts_stitches_on_one_render() -> None:
    def call(record: ContinuationRecord | None) -> CallDrift:
        return CallDrift("completed", record, None)

    report = drift_report(
        [
            call(ContinuationRecord(False, reason="no_previous_call", mode="stitch")),
            call(ContinuationRecord(True, base_call_id="c1", mode="stitch", renders=2)),
            call(ContinuationRecord(True, base_call_id="c2", mode="stitch", renders=1)),
            call(ContinuationRecord(True, base_call_id="c3", mode="stitch")),  # (older record)
            call(ContinuationRecord(True, base_call_id="c4", mode="stitch", renders=0)),
            call(None),
        ]
    )
    assert (report["stitched"], report["stitched_on_one_render"]) == (4, 1)
    assert report["stitched_rendered_here"] == 1
    assert report["fresh"] == {"no_previous_call": 1}
