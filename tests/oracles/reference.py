"""The per-call reference layout, built independently of the forest code (for verification).

One row per eligible call: its prompt + its completion, mask on the completion, behaviour logprobs
there. Eligibility (completed, trainable role, not a discarded leaf) is decided here by a plain,
quadratic transcription of DESIGN §5 rules 2–3 over Python lists — no hashing, no indexes, no code
shared with :mod:`reconstruct.forest` or :mod:`reconstruct.discard` — so tests can hold the fast
code against it. Cost ``O(N² · L)``: test-sized episodes only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from capture_contracts.bundle import CallRecord, EpisodeBundle, parse_bundle
from capture_contracts.vocabulary import DEFAULT_TRAINABLE_ROLES


@dataclass(frozen=True, slots=True)
class ReferenceRow:
    """One eligible call as its own row."""

    call_id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    behavior_logprobs: tuple[float, ...]


def _full(call: CallRecord) -> list[int]:
    return call.prompt_token_ids.tolist() + call.completion_token_ids.tolist()


def naive_parents(calls: Collection[CallRecord]) -> dict[str, str | None]:
    """Rule 2 by brute force: call id → parent call id (completed calls only)."""
    nodes = [c for c in calls if c.status == "completed"]
    parents: dict[str, str | None] = {}
    for child in nodes:
        prompt = child.prompt_token_ids.tolist()
        candidates = []
        for p in nodes:
            seq = _full(p)
            done = p.completed_seq
            if done is not None and done < child.admitted_seq and prompt[: len(seq)] == seq:
                candidates.append(p)  # the slice equals seq only if len(seq) <= len(prompt)
        if not candidates:
            parents[child.call_id] = None
            continue
        longest = max(len(_full(p)) for p in candidates)
        tied = [p for p in candidates if len(_full(p)) == longest]
        same = [p for p in tied if child.agent_id is not None and p.agent_id == child.agent_id]
        best = max(same or tied, key=lambda p: (p.completed_seq, p.admitted_seq, p.call_id))
        parents[child.call_id] = best.call_id
    return parents


def naive_discarded(calls: Collection[CallRecord]) -> set[str]:
    """Rule 3 by brute force, iterated until nothing changes: the discarded call ids."""
    nodes = {c.call_id: c for c in calls if c.status == "completed"}
    parents = naive_parents(list(nodes.values()))

    def ancestors(call_id: str) -> list[str]:
        out = []
        p = parents[call_id]
        while p is not None:
            out.append(p)
            p = parents[p]
        return out

    def retried(leaf: CallRecord) -> bool:
        return any(
            s.agent_id == leaf.agent_id
            and s.admitted_seq > (leaf.completed_seq or 0)
            and s.prompt_token_ids.tolist() == leaf.prompt_token_ids.tolist()
            for s in nodes.values()
        )

    def rolled_back(leaf: CallRecord) -> bool:
        if leaf.agent_id is None:
            return False
        above = ancestors(leaf.call_id)
        return any(
            s.agent_id == leaf.agent_id
            and parents[s.call_id] is not None
            and s.admitted_seq > (leaf.completed_seq or 0)
            and parents[s.call_id] in above
            for s in nodes.values()
        )

    discarded: set[str] = set()
    changed = True
    while changed:
        changed = False
        for leaf in nodes.values():
            if leaf.call_id in discarded:
                continue
            if any(parents[k] == leaf.call_id and k not in discarded for k in nodes):
                continue
            if leaf.mark == "discarded" or (
                leaf.mark != "accepted" and (retried(leaf) or rolled_back(leaf))
            ):
                discarded.add(leaf.call_id)
                changed = True
    return discarded


def eligible_call_ids(
    bundle: Mapping[str, Any] | EpisodeBundle,
    *,
    trainable_roles: Collection[str] = DEFAULT_TRAINABLE_ROLES,
) -> set[str]:
    """Completed calls of a trainable role that are not discarded leaves."""
    episode = bundle if isinstance(bundle, EpisodeBundle) else parse_bundle(bundle)
    discarded = naive_discarded(episode.calls)
    return {
        c.call_id
        for c in episode.calls
        if c.status == "completed" and c.role in trainable_roles and c.call_id not in discarded
    }


def reference_rows(
    bundle: Mapping[str, Any] | EpisodeBundle,
    *,
    trainable_roles: Collection[str] = DEFAULT_TRAINABLE_ROLES,
) -> list[ReferenceRow]:
    """One row per eligible call, sorted by call id."""
    episode = bundle if isinstance(bundle, EpisodeBundle) else parse_bundle(bundle)
    eligible = eligible_call_ids(episode, trainable_roles=trainable_roles)
    rows = []
    for call in sorted(episode.calls, key=lambda c: c.call_id):
        if call.call_id not in eligible:
            continue
        prompt = call.prompt_token_ids.tolist()
        completion = call.completion_token_ids.tolist()
        rows.append(
            ReferenceRow(
                call_id=call.call_id,
                input_ids=tuple(prompt + completion),
                loss_mask=(0,) * len(prompt) + (1,) * len(completion),
                behavior_logprobs=(0.0,) * len(prompt) + tuple(call.completion_logprobs.tolist()),
            )
        )
    return rows
