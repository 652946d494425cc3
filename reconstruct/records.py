"""Frozen, typed records of reconstruction's output: the accounting report and the result.

The input (the episode bundle) and the rows are shared formats: :mod:`capture_contracts.bundle`
and :mod:`capture_contracts.rows`; the drift view lives in :mod:`capture_contracts.drift`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from capture_contracts.drift import Drift
from capture_contracts.rows import Row
from capture_contracts.vocabulary import CLASSIFICATIONS, Classification, Mark


@dataclass(frozen=True, slots=True)
class MarkNote:
    """A harness mark that changed nothing, and why."""

    call_id: str
    mark: Mark
    reason: Literal["call_not_completed", "has_kept_descendants", "nothing_to_override"]

    def to_dict(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "mark": self.mark, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Accounting:
    """Where every admitted call went (DESIGN §5.7).

    ``classification`` maps every call id to exactly one class; ``counts`` sums them. Tokens:
    ``row_tokens`` of the emitted rows, ``owned_tokens`` with loss, ``reference_tokens`` of the
    per-call layout (prompt + completion of every trained call).
    """

    episode_id: str
    n_calls: int
    classification: Mapping[str, Classification]
    ambiguous_parent: tuple[str, ...]
    ineffective_marks: tuple[MarkNote, ...]
    empty_completions: tuple[str, ...]
    rows: int
    row_tokens: int
    owned_tokens: int
    reference_tokens: int
    drift: Drift

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(CLASSIFICATIONS, 0)
        for cls in self.classification.values():
            counts[cls] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "n_calls": self.n_calls,
            "counts": self.counts,
            "classification": dict(sorted(self.classification.items())),
            "ambiguous_parent": list(self.ambiguous_parent),
            "ineffective_marks": [note.to_dict() for note in self.ineffective_marks],
            "empty_completions": list(self.empty_completions),
            "rows": self.rows,
            "row_tokens": self.row_tokens,
            "owned_tokens": self.owned_tokens,
            "reference_tokens": self.reference_tokens,
            "drift": self.drift.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Reconstruction:
    """Rows plus accounting of one episode; ``parents`` maps each completed call to its parent."""

    rows: tuple[Row, ...]
    accounting: Accounting
    parents: Mapping[str, str | None]
