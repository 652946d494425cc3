"""Prometheus metrics of one proxy process (text exposition format, ``GET /metrics``).

Counters are per process, as Prometheus expects: several proxy processes on one store are summed
by the scraper. Names: ``capture_calls_admitted_total{endpoint}``,
``capture_calls_finished_total{status}`` (completed, failed, cancelled),
``capture_continuation_total{kind, reason}`` (kind = stitched | fresh; the drift report, issue 7),
``capture_calls_in_flight`` (gauge).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from capture_contracts.bundle import ContinuationRecord

Labels = tuple[tuple[str, str], ...]

_HELP = {
    "capture_calls_admitted_total": ("counter", "Calls admitted, by endpoint."),
    "capture_calls_finished_total": ("counter", "Calls that reached a terminal state."),
    "capture_continuation_total": (
        "counter",
        "Chat calls by prompt construction: stitched onto exact tokens, or rendered fresh.",
    ),
    "capture_calls_in_flight": ("gauge", "Calls this process is serving now."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        self._counters: Counter[tuple[str, Labels]] = Counter()
        self._in_flight = in_flight

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        if name not in _HELP:
            raise KeyError(f"unknown metric {name!r}")
        self._counters[(name, tuple(sorted(labels.items())))] += amount

    def admitted(self, endpoint: str, n: int, continuation: ContinuationRecord | None) -> None:
        self.inc("capture_calls_admitted_total", n, endpoint=endpoint)
        if continuation is not None and continuation.reason != "not_chat":
            if continuation.stitched:
                self.inc("capture_continuation_total", n, kind="stitched", reason="")
            else:
                reason = continuation.reason or "unknown"
                self.inc("capture_continuation_total", n, kind="fresh", reason=reason)

    def finished(self, status: str, n: int) -> None:
        if n:
            self.inc("capture_calls_finished_total", n, status=status)

    def render(self) -> str:
        lines: list[str] = []
        values: dict[str, list[tuple[Labels, int]]] = {name: [] for name in _HELP}
        for (name, labels), value in sorted(self._counters.items()):
            values[name].append((labels, value))
        values["capture_calls_in_flight"].append(((), self._in_flight()))
        for name, (kind, text) in _HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for labels, value in values[name]:
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(f"{name}{{{label_text}}} {value:g}" if labels else f"{name} {value:g}")
        return "\n".join(lines) + "\n"
