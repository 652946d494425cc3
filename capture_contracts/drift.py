"""Re-tokenisation drift (issue 7): one module for the proxy's report and the forest's view.

Per call, the proxy keeps a :class:`CallDrift` summary: its continuation record (stitched or why
rendered fresh, the call it extends) and, once it completes, whether that base call's exact
prompt + completion is a token prefix of its prompt. :func:`drift_report` sums the summaries of an
episode — a status read loads no tokens; :func:`bundle_drift` derives the same summaries from a
bundle's tokens. :class:`Drift` is the accounting report's view (reconstruction): contexts that
continued an earlier call's exact tokens vs started fresh, next to the proxy's render counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_contracts.bundle import ContinuationRecord, EpisodeBundle
from capture_contracts.vocabulary import CallStatus


@dataclass(frozen=True, slots=True)
class CallDrift:
    """What the drift report needs of one call: no tokens."""

    status: CallStatus
    continuation: ContinuationRecord | None
    token_prefix: bool | None = None  # set at completion when the call extends a recorded call


def render_counts(records: Iterable[ContinuationRecord]) -> tuple[int, Counter[str]]:
    """Stitched calls, and fresh renders by reason (``not_chat`` calls are not renders)."""
    stitched = 0
    fresh: Counter[str] = Counter()
    for record in records:
        if record.reason == "not_chat":
            continue
        if record.stitched:
            stitched += 1
        else:
            fresh[record.reason or "unknown"] += 1
    return stitched, fresh


def drift_report(calls: Iterable[CallDrift]) -> dict[str, Any]:
    """Per episode: stitched vs fresh renders and why (and of the stitched, how many took one of
    the engine's renders, and how many none: rendered in the proxy); how many continuations
    stayed token prefixes.

    A *continuation* is a completed chat call whose messages extend a recorded call of its agent;
    it is a *token prefix* when that call's prompt + completion is a prefix of its prompt.
    """
    calls = list(calls)
    records = [c.continuation for c in calls if c.continuation is not None]
    stitched, fresh = render_counts(records)
    modes = Counter(str(r.mode) for r in records if r.reason != "not_chat")
    continued = [
        c
        for c in calls
        if c.continuation is not None
        and c.continuation.reason != "not_chat"
        and c.continuation.base_call_id is not None
        and c.status == "completed"
    ]
    return {
        "modes": dict(modes),
        "stitched": stitched,
        # (stitched on the engine's full render alone: capture_proxy/stitch.py)
        "stitched_on_one_render": sum(1 for r in records if r.stitched and r.renders == 1),
        # (rendered in the proxy, no render of the engine's: capture_proxy/chat_template.py)
        "stitched_rendered_here": sum(1 for r in records if r.stitched and r.renders == 0),
        "fresh": dict(sorted(fresh.items())),
        "continuations": len(continued),
        "token_prefix_continuations": sum(1 for c in continued if c.token_prefix),
    }


def bundle_drift(bundle: EpisodeBundle) -> list[CallDrift]:
    """The per-call summaries of a bundle, token prefixes computed from its tokens."""
    by_id = {c.call_id: c for c in bundle.calls}
    out = []
    for call in bundle.calls:
        record = call.continuation
        base = by_id.get(record.base_call_id or "") if record is not None else None
        prefix = None
        if base is not None and call.status == "completed":
            full = np.concatenate([base.prompt_token_ids, base.completion_token_ids])
            prefix = bool(np.array_equal(call.prompt_token_ids[: len(full)], full))
        out.append(CallDrift(call.status, record, prefix))
    return out


@dataclass(frozen=True, slots=True)
class Drift:
    """Re-tokenisation drift of one episode, from the forest's view (the accounting report).

    ``continued``: completed calls whose prompt extends an earlier call's exact tokens (they
    have a parent); ``fresh_contexts``: completed calls that start a context (roots). From the
    proxy's records: ``stitched`` calls and fresh renders by ``reason`` (empty when the bundle
    carries no continuation records).
    """

    continued: int
    fresh_contexts: int
    stitched: int
    fresh_renders: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "continued": self.continued,
            "fresh_contexts": self.fresh_contexts,
            "stitched": self.stitched,
            "fresh_renders": dict(sorted(self.fresh_renders.items())),
        }
