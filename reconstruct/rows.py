"""Endpoints, the deterministic ownership walk and the training rows (DESIGN §5 rules 4–6).

Endpoints are kept nodes without kept children. They are walked in order of their root's
admission, then their own completion (ties: call ids). The row of endpoint E is
``E.prompt + E.completion``; it contains the generation of every node on E's root path, and owns
each eligible one not owned by an earlier row. ``loss_mask`` is 1 exactly on owned positions and
``behavior_logprobs`` carries the captured logprobs there (0.0 elsewhere). A row that owns no
position is not emitted. Worker answers pasted into a parent's prompt are prompt tokens: masked.

Complexity: each row costs ``O(len(row))`` (its root path has at most one node per completion
token when completions are non-empty), and a row is an endpoint's own sequence, so the total is
``O(T)`` plus ``O(N log N)`` for sorting.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from capture_contracts.bundle import EpisodeBundle
from capture_contracts.rows import Row, Span
from reconstruct.discard import Discards
from reconstruct.forest import Forest


def endpoint_order(forest: Forest, discards: Discards) -> list[int]:
    """Endpoints in walk order: root admission, then endpoint completion (then call ids)."""
    roots = forest.root_of()
    nodes = forest.nodes

    def key(e: int) -> tuple[int, str, int, int, str]:
        root = nodes[roots[e]]
        done = nodes[e].completed_seq
        assert done is not None
        return (root.admitted_seq, root.call_id, done, nodes[e].admitted_seq, nodes[e].call_id)

    return sorted((i for i in range(len(nodes)) if discards.is_endpoint(i)), key=key)


def build_rows(
    bundle: EpisodeBundle, forest: Forest, discards: Discards, eligible: Collection[int]
) -> tuple[Row, ...]:
    """The rows of one episode; ``eligible`` are node indices that may own loss."""
    owned: set[int] = set()
    rows: list[Row] = []
    for endpoint in endpoint_order(forest, discards):
        input_ids = forest.full[endpoint]  # [T], read-only
        loss_mask = np.zeros(len(input_ids), dtype=np.int64)  # [T]
        behavior_logprobs = np.zeros(len(input_ids), dtype=np.float64)  # [T]
        spans: list[Span] = []
        for node in forest.path(endpoint):
            call = forest.nodes[node]
            start = len(call.prompt_token_ids)
            end = start + len(call.completion_token_ids)
            owns = node in eligible and node not in owned
            if owns:
                owned.add(node)
                loss_mask[start:end] = 1
                behavior_logprobs[start:end] = call.completion_logprobs
            spans.append(
                Span(call.call_id, start, end, owns, call.weight_version, call.constrained)
            )
        if not loss_mask.any():
            continue
        loss_mask.flags.writeable = False
        behavior_logprobs.flags.writeable = False
        rows.append(
            Row(
                row_id=f"{bundle.episode_id}/{len(rows)}",
                episode_id=bundle.episode_id,
                group_id=bundle.group_id,
                reward=bundle.reward,
                input_ids=input_ids,
                loss_mask=loss_mask,
                behavior_logprobs=behavior_logprobs,
                spans=tuple(spans),
            )
        )
    return tuple(rows)
