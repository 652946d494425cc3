"""Prometheus metrics of one proxy process (text exposition format, ``GET /metrics``).

Counters and histograms are per process, as Prometheus expects: several proxy processes on one
store are summed by the scraper. The episode gauge is read from the store at scrape time, so every
process reports the same store-wide numbers (aggregate it with ``max``, not ``sum``).

Names:

- ``capture_calls_admitted_total{endpoint}``, ``capture_calls_finished_total{status}``
  (completed, failed, cancelled), ``capture_calls_total{state, role}`` (every call entering each
  state: admitted, completed, failed, cancelled), ``capture_calls_in_flight`` (gauge);
- ``capture_continuation_total{kind, reason}`` (kind = stitched | fresh; the drift report);
- ``capture_tokens_captured_total{kind}`` (prompt | completion tokens of completed calls);
- ``capture_episodes{status}`` (gauge: the store's episodes by status);
- ``capture_orphans_resolved_total`` (unresolved calls of dead proxy instances this process
  failed as ``proxy_restart``: store/leases.py);
- histograms (seconds): ``capture_upstream_latency_seconds{endpoint}`` (the generation request:
  the whole answer, or the stream from the request to its last chunk — time spent waiting on the
  engine), ``capture_proxy_overhead_seconds{endpoint}`` (the call's time in the proxy minus that
  upstream time: attribution, prompt construction (with its render round trip when stitching),
  admission, capture, commit, relaying; for a stream, also time the client takes to read),
  ``capture_commit_latency_seconds`` (the completion's transaction) and
  ``capture_continuation_plan_seconds{kind}`` (a chat call's prompt construction, part of the
  overhead: choosing the recorded call it continues and, for a stitched call, the engine's two
  renders — under load those wait behind the engine's other requests, tens of milliseconds).

The capture path measures through four small calls: :meth:`Metrics.timer` when a request
arrives, :meth:`CallTimer.upstream` around the engine's answer (for a stream, around each wait
for its next piece), :meth:`Metrics.planned` once its prompt is planned, and
:meth:`Metrics.observe` when the call is over;
:meth:`Metrics.commit_timer` wraps the completion's transaction.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from capture_contracts.bundle import ContinuationRecord

Labels = tuple[tuple[str, str], ...]
T = TypeVar("T")

#: Bucket upper bounds (seconds). An engine answer takes from milliseconds to minutes; the proxy's
#: own work and a commit are expected in the sub-millisecond to tens-of-milliseconds range.
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_HELP = {
    "capture_calls_admitted_total": ("counter", "Calls admitted, by endpoint."),
    "capture_calls_finished_total": ("counter", "Calls that reached a terminal state."),
    "capture_calls_total": ("counter", "Calls entering each state, by state and role."),
    "capture_continuation_total": (
        "counter",
        "Chat calls by prompt construction: stitched onto exact tokens, or rendered fresh.",
    ),
    "capture_tokens_captured_total": (
        "counter",
        "Tokens recorded by completed calls: prompt and completion.",
    ),
    "capture_calls_in_flight": ("gauge", "Calls this process is serving now."),
    "capture_orphans_resolved_total": (
        "counter",
        "Unresolved calls of dead proxy instances this process failed as proxy_restart.",
    ),
    "capture_episodes": ("gauge", "Episodes in the store by status (store-wide, read at scrape)."),
    "capture_upstream_latency_seconds": (
        "histogram",
        "Time waiting on the engine for one request's answer (whole body or whole stream).",
    ),
    "capture_proxy_overhead_seconds": (
        "histogram",
        "A request's time in the proxy minus its upstream time.",
    ),
    "capture_commit_latency_seconds": (
        "histogram",
        "Duration of the transaction that commits a completion.",
    ),
    "capture_continuation_plan_seconds": (
        "histogram",
        "A chat call's prompt construction (stitched: with the engine's renders), by kind.",
    ),
}
_BUCKETS = {
    "capture_upstream_latency_seconds": UPSTREAM_BUCKETS,
    "capture_proxy_overhead_seconds": FAST_BUCKETS,
    "capture_commit_latency_seconds": FAST_BUCKETS,
    "capture_continuation_plan_seconds": FAST_BUCKETS,
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: Labels, value: float) -> str:
    if not labels:
        return f"{name} {value:g}"
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{text}}} {value:g}"


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram of one label set (Prometheus ``histogram`` type)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: Labels) -> list[str]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        out, running = [], 0
        for bound, count in zip([*self.bounds, float("inf")], counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(_sample(f"{name}_bucket", (*labels, ("le", le)), running))
        out.append(_sample(f"{name}_sum", labels, self.total))
        out.append(_sample(f"{name}_count", labels, self.n))
        return out


@dataclass(slots=True)
class CallTimer:
    """One request's clock: started when it arrives, upstream time added as it is awaited."""

    endpoint: str
    began: float = field(default_factory=time.perf_counter)
    upstream_s: float = 0.0

    async def upstream(self, awaitable: Awaitable[T]) -> T:
        """Await the engine (a whole answer, a stream's headers or its next piece), counting
        the wait."""
        started = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.upstream_s += time.perf_counter() - started


class Metrics:
    def __init__(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        self._counters: Counter[tuple[str, Labels]] = Counter()
        self._histograms: dict[tuple[str, Labels], Histogram] = {}
        self._in_flight = in_flight

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        if _HELP.get(name, ("",))[0] != "counter":
            raise KeyError(f"unknown counter {name!r}")
        self._counters[(name, tuple(sorted(labels.items())))] += amount

    def observe_seconds(self, name: str, value: float, **labels: str) -> None:
        if name not in _BUCKETS:
            raise KeyError(f"unknown histogram {name!r}")
        key = (name, tuple(sorted(labels.items())))
        if key not in self._histograms:
            self._histograms[key] = Histogram(_BUCKETS[name])
        self._histograms[key].observe(value)

    # -- the capture path's measurement points ------------------------------------------------

    def admitted(
        self, endpoint: str, n: int, continuation: ContinuationRecord | None, role: str = ""
    ) -> None:
        self.inc("capture_calls_admitted_total", n, endpoint=endpoint)
        self.inc("capture_calls_total", n, state="admitted", role=role)
        if continuation is not None and continuation.reason != "not_chat":
            if continuation.stitched:
                self.inc("capture_continuation_total", n, kind="stitched", reason="")
            else:
                reason = continuation.reason or "unknown"
                self.inc("capture_continuation_total", n, kind="fresh", reason=reason)

    def planned(self, continuation: ContinuationRecord | None, seconds: float) -> None:
        """A chat call's prompt was planned in ``seconds`` (stitched, or fresh)."""
        if continuation is None or continuation.reason == "not_chat":
            return
        kind = "stitched" if continuation.stitched else "fresh"
        self.observe_seconds("capture_continuation_plan_seconds", seconds, kind=kind)

    def finished(
        self, status: str, n: int, role: str = "", tokens: tuple[int, int] = (0, 0)
    ) -> None:
        """``n`` calls of one request reached ``status``; ``tokens`` = (prompt, completion)."""
        if not n:
            return
        self.inc("capture_calls_finished_total", n, status=status)
        self.inc("capture_calls_total", n, state=status, role=role)
        if tokens[0]:
            self.inc("capture_tokens_captured_total", tokens[0], kind="prompt")
        if tokens[1]:
            self.inc("capture_tokens_captured_total", tokens[1], kind="completion")

    def orphans_resolved(self, n: int) -> None:
        if n:
            self.inc("capture_orphans_resolved_total", n)

    def timer(self, endpoint: str) -> CallTimer:
        return CallTimer(endpoint)

    def observe(self, timer: CallTimer) -> None:
        """The request is over: record its upstream time and the proxy's overhead."""
        total = time.perf_counter() - timer.began
        endpoint = timer.endpoint
        self.observe_seconds(
            "capture_upstream_latency_seconds", timer.upstream_s, endpoint=endpoint
        )
        overhead = max(total - timer.upstream_s, 0.0)
        self.observe_seconds("capture_proxy_overhead_seconds", overhead, endpoint=endpoint)

    @contextmanager
    def commit_timer(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe_seconds("capture_commit_latency_seconds", time.perf_counter() - started)

    # -- exposition -----------------------------------------------------------------------------

    def render(self, episodes: Mapping[str, int] | None = None) -> str:
        """The text format; ``episodes`` (status → count) is the store's gauge, if it answered."""
        counters: dict[str, list[tuple[Labels, float]]] = {name: [] for name in _HELP}
        for (name, labels), value in sorted(self._counters.items()):
            counters[name].append((labels, value))
        counters["capture_calls_in_flight"].append(((), self._in_flight()))
        for status, count in sorted((episodes or {}).items()):
            counters["capture_episodes"].append(((("status", status),), count))
        lines: list[str] = []
        for name, (kind, text) in _HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                for (h_name, labels), histogram in sorted(self._histograms.items()):
                    if h_name == name:
                        lines += histogram.lines(name, labels)
                continue
            lines += [_sample(name, labels, value) for labels, value in counters[name]]
        return "\n".join(lines) + "\n"
