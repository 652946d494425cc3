"""What the demo shows: per-episode figures and a rich summary (the HTML page of each episode is
the proxy's viewer, :mod:`capture_proxy.viewer`).

Pure functions over an episode bundle (``capture-episode/v1``), the rows the job emitted for it and
its reconstruction's parent links; no I/O except :func:`write_html`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True, slots=True)
class EpisodeFigures:
    episode_id: str
    reward: float | None
    calls_by_class: Mapping[str, int]
    rows: int
    trained_tokens_by_agent: Mapping[str, int]
    continued_by_agent: Mapping[str, int]  # calls whose parent is an earlier call's exact tokens
    fresh_by_agent: Mapping[str, int]  # calls that start a new root
    row_tokens: int
    reference_tokens: int
    stitched: int = 0  # calls whose prompt continues an earlier call's exact tokens
    rendered_here: int = 0  # of those, rendered from the chat template in the proxy
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "reward": self.reward,
            "calls_by_class": dict(self.calls_by_class),
            "rows": self.rows,
            "trained_tokens_by_agent": dict(self.trained_tokens_by_agent),
            "continued_by_agent": dict(self.continued_by_agent),
            "fresh_by_agent": dict(self.fresh_by_agent),
            "row_tokens": self.row_tokens,
            "reference_tokens": self.reference_tokens,
            "stitched": self.stitched,
            "rendered_here": self.rendered_here,
        }


def agent_label(call: Mapping[str, Any]) -> str:
    return str(call.get("agent_id") or "(unlabelled)")


def episode_figures(
    bundle: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    accounting: Mapping[str, Any],
    parents: Mapping[str, str | None],
) -> EpisodeFigures:
    agents = {c["call_id"]: agent_label(c) for c in bundle["calls"]}
    trained: Counter[str] = Counter()
    for row in rows:
        for span in row["spans"]:
            # Grammar-forced spans are owned but not trained (trainer_bridge/batch.py).
            if span["owned"] and not span.get("constrained"):
                trained[agents[span["call_id"]]] += int(span["end"]) - int(span["start"])
    continued: Counter[str] = Counter()
    fresh: Counter[str] = Counter()
    for call_id, parent in parents.items():
        (fresh if parent is None else continued)[agents[call_id]] += 1
    for agent in set(continued) | set(fresh):
        continued.setdefault(agent, 0)
        fresh.setdefault(agent, 0)
    stitched = [c["continuation"] for c in bundle["calls"] if _stitched(c)]
    return EpisodeFigures(
        episode_id=str(bundle["episode_id"]),
        reward=bundle.get("reward"),
        calls_by_class={k: v for k, v in accounting["counts"].items() if v},
        rows=len(rows),
        trained_tokens_by_agent=dict(sorted(trained.items())),
        continued_by_agent=dict(sorted(continued.items())),
        fresh_by_agent=dict(sorted(fresh.items())),
        row_tokens=int(accounting["row_tokens"]),
        reference_tokens=int(accounting["reference_tokens"]),
        stitched=len(stitched),
        rendered_here=sum(1 for record in stitched if record.get("renders") == 0),
    )


def _stitched(call: Mapping[str, Any]) -> bool:
    record = call.get("continuation")
    return isinstance(record, Mapping) and bool(record.get("stitched"))


def print_summary(
    console: Console, figures: Sequence[EpisodeFigures], train: Mapping[str, Any] | None
) -> None:
    table = Table(title="episodes (one GRPO group)", show_lines=True)
    for name in ("episode", "reward", "calls by class", "rows", "trained tokens by agent"):
        table.add_column(name)
    table.add_column("continued / fresh context, per agent")
    table.add_column("stitched calls (rendered in the proxy)")
    for fig in figures:
        table.add_row(
            fig.episode_id,
            "-" if fig.reward is None else f"{fig.reward:g}",
            "\n".join(f"{k}: {v}" for k, v in fig.calls_by_class.items()),
            f"{fig.rows}\n({fig.row_tokens} tok; per-call {fig.reference_tokens})",
            "\n".join(f"{k}: {v}" for k, v in fig.trained_tokens_by_agent.items()),
            "\n".join(
                f"{k}: {fig.continued_by_agent[k]} / {fig.fresh_by_agent[k]}"
                for k in fig.fresh_by_agent
            ),
            f"{fig.stitched} ({fig.rendered_here})",
        )
    console.print(table)
    if train is None:
        return
    stats = Table(title="learner step", show_header=True)
    stats.add_column("metric")
    stats.add_column("value", justify="right")
    for key, value in train.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
        stats.add_row(key, _fmt(value))
    console.print(stats)


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_html(path: Path, page: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
