"""Accounting: every admitted call classified exactly once (DESIGN §5 rule 7).

``trained`` — a kept node of a trainable role; ``conditioning_only`` — a kept node of another role
(auxiliary, or a role not trained in this run): it conditions descendants but owns no loss;
``discarded_retry`` — a discarded leaf (harness mark, retry or rollback); ``failed``,
``cancelled``; ``unresolved`` — still ``admitted``.
"""

from __future__ import annotations

from collections.abc import Collection

from capture_contracts.bundle import EpisodeBundle
from capture_contracts.drift import Drift, render_counts
from capture_contracts.rows import Row
from capture_contracts.vocabulary import Classification
from reconstruct.discard import Discards, ineffective_marks
from reconstruct.errors import EpisodeRefused
from reconstruct.forest import Forest
from reconstruct.records import Accounting


def classify(
    bundle: EpisodeBundle, forest: Forest, discards: Discards, trainable_roles: Collection[str]
) -> dict[str, Classification]:
    """Call id → its one class."""
    node_index = {call.call_id: i for i, call in enumerate(forest.nodes)}
    out: dict[str, Classification] = {}
    for call in bundle.calls:
        cls: Classification
        if call.status == "admitted":
            cls = "unresolved"
        elif call.status == "failed":
            cls = "failed"
        elif call.status == "cancelled":
            cls = "cancelled"
        elif node_index[call.call_id] in discards.reason:
            cls = "discarded_retry"
        elif call.role in trainable_roles:
            cls = "trained"
        else:
            cls = "conditioning_only"
        out[call.call_id] = cls
    return out


def drift(bundle: EpisodeBundle, forest: Forest) -> Drift:
    """Continued vs fresh contexts (forest) and stitched vs fresh renders (proxy records)."""
    roots = sum(1 for parent in forest.parent if parent is None)
    stitched, fresh = render_counts(c.continuation for c in bundle.calls if c.continuation)
    return Drift(
        continued=len(forest.nodes) - roots,
        fresh_contexts=roots,
        stitched=stitched,
        fresh_renders=dict(fresh),
    )


def build_accounting(
    bundle: EpisodeBundle,
    forest: Forest,
    discards: Discards,
    classification: dict[str, Classification],
    rows: tuple[Row, ...],
) -> Accounting:
    """The report; refuses (:class:`EpisodeRefused`) when the counts do not add up."""
    accounting = Accounting(
        episode_id=bundle.episode_id,
        n_calls=len(bundle.calls),
        classification=dict(sorted(classification.items())),
        ambiguous_parent=tuple(sorted(forest.nodes[i].call_id for i in forest.ambiguous_parent)),
        ineffective_marks=ineffective_marks(bundle.calls, forest, discards),
        empty_completions=tuple(
            sorted(
                call.call_id
                for call in bundle.calls
                if classification[call.call_id] == "trained" and len(call.completion_token_ids) == 0
            )
        ),
        rows=len(rows),
        row_tokens=sum(len(row.input_ids) for row in rows),
        owned_tokens=sum(int(row.loss_mask.sum()) for row in rows),
        reference_tokens=sum(
            len(call.prompt_token_ids) + len(call.completion_token_ids)
            for call in bundle.calls
            if classification[call.call_id] == "trained"
        ),
        drift=drift(bundle, forest),
    )
    check_accounting(accounting)
    return accounting


def check_accounting(accounting: Accounting) -> None:
    """Refuse an episode whose classes do not add up to its calls, or that has unresolved ones."""
    counts = accounting.counts
    if sum(counts.values()) != accounting.n_calls or len(accounting.classification) != (
        accounting.n_calls
    ):
        raise EpisodeRefused(
            f"episode {accounting.episode_id!r}: accounting does not add up "
            f"({counts} for {accounting.n_calls} admitted calls)",
            code="accounting_mismatch",
        )
    if counts["unresolved"]:
        unresolved = sorted(c for c, k in accounting.classification.items() if k == "unresolved")
        raise EpisodeRefused(
            f"episode {accounting.episode_id!r}: {len(unresolved)} unresolved call(s) "
            f"{unresolved[:5]}",
            code="unresolved_calls",
        )
