"""Write the golden reconstruction corpus: ``python -m tests.golden.make_golden`` (repo root).

Each ``tests/golden/<case>.json`` holds ``{"case", "description", "bundle", "expected": {"rows",
"accounting"}}``. The expected part is produced by the code under test, so every case is also
pinned by hand-derived facts (row count, owners, mask sums, classes) in
``tests/reconstruct/test_golden.py``; regenerate only after checking those still hold.

Completions are 3 tokens unless stated; prompts are built from fresh token ids so that prefix
relations are exactly the intended ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconstruct import reconstruct_episode
from tests.support.builders import EpisodeBuilder

GOLDEN_DIR = Path(__file__).parent


def linear_chain() -> dict[str, Any]:
    """One agent, 4 calls, each continuing the previous context: 1 row owning all 4."""
    b = EpisodeBuilder("ep-linear")
    ctx = b.fresh(4)
    for i in range(1, 5):
        ctx = b.call(f"a{i}", ctx, agent="a") + b.fresh(2)
    return b.bundle()


def interleaved_roots() -> dict[str, Any]:
    """Agents a and b, unrelated contexts, calls interleaved: 2 rows, a's first (admitted first)."""
    b = EpisodeBuilder("ep-interleaved")
    pa, pb = b.fresh(4), b.fresh(5)
    b.admit("a1", pa, agent="a")
    b.admit("b1", pb, agent="b")
    b.complete("b1")
    b.complete("a1")
    b.admit("b2", b.full("b1") + b.fresh(2), agent="b")
    b.admit("a2", b.full("a1") + b.fresh(2), agent="a")
    b.complete("b2")
    b.complete("a2")
    return b.bundle()


def shared_prefix_fork() -> dict[str, Any]:
    """p, then agents x and y both continue p's context: 2 rows; y completes first, owns p."""
    b = EpisodeBuilder("ep-fork")
    full_p = b.call("p", b.fresh(4), agent="parent")
    b.admit("x", full_p + b.fresh(2), agent="x", parent_agent="parent")
    b.admit("y", full_p + b.fresh(2), agent="y", parent_agent="parent")
    b.complete("y")
    b.complete("x")
    return b.bundle()


def parent_workers_resume() -> dict[str, Any]:
    """Parent p1 delegates to workers w1, w2 (own contexts, 2 calls each) and resumes with their
    answers pasted into its prompt: rows p1→p2, w1, w2; pasted answers are masked."""
    b = EpisodeBuilder("ep-workers")
    full_p1 = b.call("p1", b.fresh(4), agent="parent")
    for w in ("w1", "w2"):
        b.admit(f"{w}-1", b.fresh(3), agent=w, parent_agent="parent")
    for w in ("w1", "w2"):
        b.complete(f"{w}-1")
    for w in ("w2", "w1"):
        b.call(f"{w}-2", b.full(f"{w}-1") + b.fresh(2), agent=w, parent_agent="parent")
    answers = b.completion("w1-2") + b.completion("w2-2")
    b.call("p2", full_p1 + b.fresh(1) + answers + b.fresh(1), agent="parent")
    return b.bundle()


def nested_forks() -> dict[str, Any]:
    """p forks to a and b; a forks to c and d (all different agents): 3 rows."""
    b = EpisodeBuilder("ep-nested")
    full_p = b.call("p", b.fresh(4), agent="p")
    full_a = b.call("a", full_p + b.fresh(2), agent="a")
    b.call("b", full_p + b.fresh(2), agent="b")
    b.call("c", full_a + b.fresh(2), agent="c")
    b.call("d", full_a + b.fresh(2), agent="d")
    return b.bundle()


def compaction_in_worker() -> dict[str, Any]:
    """Worker w: w1→w2→wc (compaction, continues w2), then a rewritten context w3 (summary, a new
    root) → w4; parent p1→p2. Rows: parent, worker before compaction, worker after."""
    b = EpisodeBuilder("ep-compaction")
    full_p1 = b.call("p1", b.fresh(4), agent="parent")
    full_w1 = b.call("w1", b.fresh(3), agent="w", parent_agent="parent")
    full_w2 = b.call("w2", full_w1 + b.fresh(2), agent="w", parent_agent="parent")
    b.call("wc", full_w2 + b.fresh(2), agent="w", role="compaction")
    summary = b.completion("wc")
    full_w3 = b.call("w3", b.fresh(2) + summary + b.fresh(1), agent="w", parent_agent="parent")
    b.call("w4", full_w3 + b.fresh(2), agent="w", parent_agent="parent")
    b.call("p2", full_p1 + b.completion("w4"), agent="parent")
    return b.bundle()


def retried_call() -> dict[str, Any]:
    """a1→a2; a2 is retried with the same prompt (a2r, after a2 completed); a2r→a3: a2 discarded."""
    b = EpisodeBuilder("ep-retry")
    full_a1 = b.call("a1", b.fresh(4), agent="a")
    prompt2 = full_a1 + b.fresh(2)
    b.call("a2", prompt2, agent="a")
    full_a2r = b.call("a2r", prompt2, agent="a")
    b.call("a3", full_a2r + b.fresh(2), agent="a")
    return b.bundle()


def same_agent_rollback() -> dict[str, Any]:
    """a1→a2→a3, then agent a goes back to a1's context (a2b): a3 then a2 are discarded."""
    b = EpisodeBuilder("ep-rollback")
    full_a1 = b.call("a1", b.fresh(4), agent="a")
    full_a2 = b.call("a2", full_a1 + b.fresh(2), agent="a")
    b.call("a3", full_a2 + b.fresh(2), agent="a")
    b.call("a2b", full_a1 + b.fresh(2), agent="a")
    return b.bundle()


def harness_marked_discard() -> dict[str, Any]:
    """a1→a2→a3 with a3 marked discarded (row ends at a2); a1's discard mark changes nothing."""
    b = EpisodeBuilder("ep-mark-discard")
    full_a1 = b.call("a1", b.fresh(4), agent="a", mark="discarded")
    full_a2 = b.call("a2", full_a1 + b.fresh(2), agent="a")
    b.call("a3", full_a2 + b.fresh(2), agent="a", mark="discarded")
    return b.bundle()


def harness_marked_accept() -> dict[str, Any]:
    """a1→a2 (accepted) and later a1→a2b by the same agent: the rollback is overridden, 2 rows.
    a1's accept (has kept descendants) and a2b's (nothing to override) change nothing."""
    b = EpisodeBuilder("ep-mark-accept")
    full_a1 = b.call("a1", b.fresh(4), agent="a", mark="accepted")
    b.call("a2", full_a1 + b.fresh(2), agent="a", mark="accepted")
    b.call("a2b", full_a1 + b.fresh(2), agent="a", mark="accepted")
    return b.bundle()


def auxiliary_calls() -> dict[str, Any]:
    """Chain a1→a2; a title call t (auxiliary, no descendants: no row); an auxiliary call x whose
    context policy call y continues (x conditions y, unowned)."""
    b = EpisodeBuilder("ep-aux")
    full_a1 = b.call("a1", b.fresh(4), agent="a")
    b.call("t", b.fresh(3), role="auxiliary")
    b.call("a2", full_a1 + b.fresh(2), agent="a")
    full_x = b.call("x", b.fresh(3), agent="x", role="auxiliary")
    b.call("y", full_x + b.fresh(2), agent="x")
    return b.bundle()


def auxiliary_fork_leaf() -> dict[str, Any]:
    """p1 → unlabelled auxiliary leaf t and p1 → p2. t is an endpoint completing before p2, so by
    §5.5 its row is walked first and owns p1; p2's row owns p2. 2 rows, t's generation unowned.
    (Were t labelled with p's agent, p2 would discard it by rule 3c.)"""
    b = EpisodeBuilder("ep-aux-fork")
    full_p1 = b.call("p1", b.fresh(4), agent="a")
    b.call("t", full_p1 + b.fresh(2), role="auxiliary")
    b.call("p2", full_p1 + b.fresh(1), agent="a")
    return b.bundle()


def failed_and_cancelled() -> dict[str, Any]:
    """a1→a2, plus a failed call (prompt known) and a cancelled call: 1 row; both accounted."""
    b = EpisodeBuilder("ep-failed")
    full_a1 = b.call("a1", b.fresh(4), agent="a")
    b.admit("f", full_a1 + b.fresh(2), agent="a")
    b.end("f", "failed")
    b.admit("k", [], agent="a")
    b.end("k", "cancelled")
    b.call("a2", full_a1 + b.fresh(2), agent="a")
    return b.bundle()


def n2_siblings() -> dict[str, Any]:
    """p, then one request with n=2: two choices, same prompt. 2 rows; the first to complete
    (choice -1) is walked first and owns p."""
    b = EpisodeBuilder("ep-n2")
    full_p = b.call("p", b.fresh(4), agent="a")
    prompt = full_p + b.fresh(2)
    b.admit("c-0", prompt, agent="a")
    b.admit("c-1", prompt, agent="a")
    b.complete("c-1")
    b.complete("c-0")
    return b.bundle()


def ambiguous_tie() -> dict[str, Any]:
    """Unlabelled n=2 choices with the same completion, then a continuation: a tie broken by
    completion order (latest, s1) without an agent id → ambiguous_parent [c]."""
    b = EpisodeBuilder("ep-tie")
    prompt = b.fresh(4)
    same = b.fresh(3)
    b.admit("s0", prompt)
    b.admit("s1", prompt)
    b.complete("s0", same)
    full_s1 = b.complete("s1", same)
    b.call("c", full_s1 + b.fresh(2))
    return b.bundle()


def chain20_compaction() -> dict[str, Any]:
    """20 calls of one agent: 10 policy turns, a compaction call continuing turn 10, then 9 turns
    in the rewritten context: 2 rows (11 and 9 generations)."""
    b = EpisodeBuilder("ep-chain20")
    ctx = b.fresh(4)
    for i in range(1, 11):
        ctx = b.call(f"t{i:02d}", ctx, agent="a") + b.fresh(2)
    b.call("compact", ctx, agent="a", role="compaction")
    ctx = b.fresh(2) + b.completion("compact")
    for i in range(12, 21):
        ctx = b.call(f"t{i:02d}", ctx, agent="a") + b.fresh(2)
    return b.bundle()


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    fn.__name__: fn
    for fn in (
        linear_chain,
        interleaved_roots,
        shared_prefix_fork,
        parent_workers_resume,
        nested_forks,
        compaction_in_worker,
        retried_call,
        same_agent_rollback,
        harness_marked_discard,
        harness_marked_accept,
        auxiliary_calls,
        auxiliary_fork_leaf,
        failed_and_cancelled,
        n2_siblings,
        ambiguous_tie,
        chain20_compaction,
    )
}


def golden_case(name: str) -> dict[str, Any]:
    bundle = SCENARIOS[name]()
    result = reconstruct_episode(bundle)
    return {
        "case": name,
        "description": " ".join((SCENARIOS[name].__doc__ or "").split()),
        "bundle": bundle,
        "expected": {
            "rows": [row.to_dict() for row in result.rows],
            "accounting": result.accounting.to_dict(),
        },
    }


_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][-0-9.e,\s]*?)\s*\]")


def dumps(case: dict[str, Any]) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(case, indent=1, ensure_ascii=False)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                            text)  # fmt: skip


def main() -> None:
    for name in SCENARIOS:
        path = GOLDEN_DIR / f"{name}.json"
        path.write_text(dumps(golden_case(name)) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
