"""Discarded leaves: retries and abandoned branches (DESIGN §5 rule 3).

Repeat until nothing changes: a leaf L (a node with no kept child) is discarded when

(a) the harness marked it ``discarded``, or
(b) a later node S of the same agent (both unlabelled counts as same), admitted after L completed,
    has exactly ``L.prompt`` as its prompt (a retry), or
(c) L's agent is labelled and a later non-root node S of that agent, admitted after L completed, has
    as parent L's parent or an ancestor of it (the agent went back). Roots discard nothing;
    different agents branching from one call are a shared-prefix fork and are both kept.

A harness ``accepted`` mark overrides (b) and (c). Whether (a)–(c) hold for a leaf depends only on
the forest, not on other discards, and leafness only grows as leaves are discarded, so a worklist
(discarding a leaf may turn its parent into a leaf) reaches the unique fixpoint.

Complexity: (b) is a dict lookup on ``(agent, len, hash)`` of the prompt plus one numpy comparison;
(c) walks up from L comparing, per ancestor X, the latest admission of a child of X by L's agent —
``O(depth(L)) ≤ O(len(L.prompt))`` when completions are non-empty. Total ``O(T)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from capture_contracts.bundle import CallRecord
from reconstruct.forest import Forest
from reconstruct.records import MarkNote

DiscardReason = Literal["mark", "retry", "rollback"]


@dataclass(frozen=True, slots=True)
class Discards:
    """The fixpoint of rule 3. Indices refer to ``forest.nodes``."""

    reason: Mapping[int, DiscardReason]  # every discarded node and the rule that discarded it
    kept_children: tuple[int, ...]  # number of kept (non-discarded) children per node
    overridden: frozenset[int]  # leaves an ``accepted`` mark saved from (b) or (c)

    @property
    def discarded(self) -> frozenset[int]:
        return frozenset(self.reason)

    def is_endpoint(self, node: int) -> bool:
        """A kept node without kept children."""
        return node not in self.reason and self.kept_children[node] == 0


class _Rules:
    """Rule (b) and (c) tests for one forest, with their indexes built once."""

    def __init__(self, forest: Forest) -> None:
        self.forest = forest
        nodes = forest.nodes
        self.same_prompt: dict[tuple[str | None, int, int], list[int]] = {}
        for i, call in enumerate(nodes):
            key = (call.agent_id, len(call.prompt_token_ids), forest.prompt_hash[i])
            self.same_prompt.setdefault(key, []).append(i)
        # latest_child[x][agent] = latest admission of a child of x by that (labelled) agent
        self.latest_child: list[dict[str, int]] = [{} for _ in nodes]
        for i, p in enumerate(forest.parent):
            agent = nodes[i].agent_id
            if p is not None and agent is not None:
                seen = self.latest_child[p].get(agent, -1)
                self.latest_child[p][agent] = max(seen, nodes[i].admitted_seq)

    def retried(self, leaf: int) -> bool:
        call = self.forest.nodes[leaf]
        done = _completed_seq(call)
        key = (call.agent_id, len(call.prompt_token_ids), self.forest.prompt_hash[leaf])
        return any(
            self.forest.nodes[s].admitted_seq > done
            and np.array_equal(self.forest.nodes[s].prompt_token_ids, call.prompt_token_ids)
            for s in self.same_prompt[key]
        )

    def rolled_back(self, leaf: int) -> bool:
        call = self.forest.nodes[leaf]
        if call.agent_id is None:
            return False
        done = _completed_seq(call)
        ancestor = self.forest.parent[leaf]
        while ancestor is not None:
            if self.latest_child[ancestor].get(call.agent_id, -1) > done:
                return True
            ancestor = self.forest.parent[ancestor]
        return False


def _completed_seq(call: CallRecord) -> int:
    assert call.completed_seq is not None
    return call.completed_seq


def find_discards(forest: Forest) -> Discards:
    """Apply rule 3 until nothing changes."""
    rules = _Rules(forest)
    kept_children = [len(ch) for ch in forest.children]
    reason: dict[int, DiscardReason] = {}
    overridden: set[int] = set()
    work = [i for i, n in enumerate(kept_children) if n == 0]
    while work:
        leaf = work.pop()
        call = forest.nodes[leaf]
        found: DiscardReason | None = None
        if call.mark == "discarded":
            found = "mark"
        elif rules.retried(leaf):
            found = "retry"
        elif rules.rolled_back(leaf):
            found = "rollback"
        if found is not None and found != "mark" and call.mark == "accepted":
            overridden.add(leaf)
            found = None
        if found is None:
            continue
        reason[leaf] = found
        p = forest.parent[leaf]
        if p is not None:
            kept_children[p] -= 1
            if kept_children[p] == 0:
                work.append(p)
    return Discards(
        reason=dict(sorted(reason.items())),
        kept_children=tuple(kept_children),
        overridden=frozenset(overridden),
    )


def ineffective_marks(
    calls: Sequence[CallRecord], forest: Forest, discards: Discards
) -> tuple[MarkNote, ...]:
    """Harness marks that changed nothing, sorted by call id.

    A mark on a call that is not completed, or that has kept descendants, changes nothing; so does
    an ``accepted`` mark on a leaf that (b) and (c) would have kept anyway.
    """
    index = {call.call_id: i for i, call in enumerate(forest.nodes)}
    notes: list[MarkNote] = []
    for call in sorted(calls, key=lambda c: c.call_id):
        if call.mark is None:
            continue
        node = index.get(call.call_id)
        if node is None:
            notes.append(MarkNote(call.call_id, call.mark, "call_not_completed"))
        elif discards.kept_children[node] > 0:
            notes.append(MarkNote(call.call_id, call.mark, "has_kept_descendants"))
        elif call.mark == "accepted" and node not in discards.overridden:
            notes.append(MarkNote(call.call_id, call.mark, "nothing_to_override"))
    return tuple(notes)
