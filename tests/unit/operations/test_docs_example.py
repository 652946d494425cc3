"""docs/reconstruction.md's worked example, run through the core: every figure on the page holds."""

from __future__ import annotations

from typing import Any

from reconstruct import reconstruct_episode


def _call(
    call_id: str, agent: str, role: str, seqs: tuple[int, int], prompt: list[int],
    completion: list[int], status: str = "completed",
) -> dict[str, Any]:  # fmt: skip
    return {
        "call_id": call_id,
        "agent_id": agent,
        "parent_agent_id": "parent" if agent == "worker" else None,
        "role": role,
        "status": status,
        "mark": None,
        "admitted_seq": seqs[0],
        "completed_seq": seqs[1] if status == "completed" else None,
        "finish_reason": "stop" if status == "completed" else None,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [-0.5] * len(completion),
    }


EXAMPLE = {
    "schema": "capture-episode/v1",
    "episode_id": "ex",
    "group_id": "task",
    "status": "closed",
    "reward": 1.0,
    "calls": [
        _call("p1", "parent", "policy", (1, 2), [1, 2, 3], [10, 11]),
        _call("t1", "parent", "auxiliary", (3, 4), [50, 51], [52]),
        _call("w1", "worker", "policy", (5, 6), [30, 31], [32, 33]),
        _call("w2", "worker", "policy", (7, 8), [30, 31, 32, 33, 34], [], status="failed"),
        _call("w3", "worker", "policy", (9, 10), [30, 31, 32, 33, 34], [35]),
        _call("p2", "parent", "policy", (11, 12), [1, 2, 3, 10, 11, 12, 35], [13]),
        _call("p3", "parent", "policy", (13, 14), [1, 2, 3, 10, 11, 12, 35], [14]),
    ],
}


def test_the_worked_example_holds() -> None:
    result = reconstruct_episode(EXAMPLE)
    assert dict(result.parents) == {
        "p1": None, "t1": None, "w1": None, "w3": "w1", "p2": "p1", "p3": "p1",
    }  # fmt: skip
    rows = [row.to_dict() for row in result.rows]
    assert [r["row_id"] for r in rows] == ["ex/0", "ex/1"]
    assert rows[0]["input_ids"] == [1, 2, 3, 10, 11, 12, 35, 14]
    assert rows[0]["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1]
    assert rows[1]["input_ids"] == [30, 31, 32, 33, 34, 35]
    assert rows[1]["loss_mask"] == [0, 0, 1, 1, 0, 1]
    assert rows[0]["behavior_logprobs"] == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    owned = [[(s["call_id"], s["start"], s["end"]) for s in r["spans"] if s["owned"]] for r in rows]
    assert owned == [[("p1", 3, 5), ("p3", 7, 8)], [("w1", 2, 4), ("w3", 5, 6)]]
    report = result.accounting.to_dict()
    assert report["counts"] == {
        "trained": 4, "conditioning_only": 1, "discarded_retry": 1, "failed": 1,
        "cancelled": 0, "unresolved": 0,
    }  # fmt: skip
    assert report["classification"] == {
        "p1": "trained", "p2": "discarded_retry", "p3": "trained", "t1": "conditioning_only",
        "w1": "trained", "w2": "failed", "w3": "trained",
    }  # fmt: skip
    assert (report["rows"], report["row_tokens"], report["owned_tokens"]) == (2, 14, 6)
    assert report["reference_tokens"] == 23
