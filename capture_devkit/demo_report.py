"""What the demo shows: per-episode figures, a rich summary, and an HTML view of each forest.

Pure functions over an episode bundle (``capture-episode/v1``), the rows the job emitted for it and
its reconstruction's parent links; no I/O except :func:`write_html`.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROW_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948")


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
            if span["owned"]:
                trained[agents[span["call_id"]]] += int(span["end"]) - int(span["start"])
    continued: Counter[str] = Counter()
    fresh: Counter[str] = Counter()
    for call_id, parent in parents.items():
        (fresh if parent is None else continued)[agents[call_id]] += 1
    for agent in set(continued) | set(fresh):
        continued.setdefault(agent, 0)
        fresh.setdefault(agent, 0)
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
    )


def print_summary(
    console: Console, figures: Sequence[EpisodeFigures], train: Mapping[str, Any] | None
) -> None:
    table = Table(title="episodes (one GRPO group)", show_lines=True)
    for name in ("episode", "reward", "calls by class", "rows", "trained tokens by agent"):
        table.add_column(name)
    table.add_column("continued / fresh context, per agent")
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


# -- HTML forest view ----------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
ul.tree{list-style:none;padding-left:1.6em;border-left:1px dashed #bbb}
ul.tree.top{border-left:none;padding-left:0}
.node{display:inline-block;margin:.25em 0;padding:.3em .6em;border-radius:6px;
 border:3px solid #ccc;background:#fafafa;font-size:.9em}
.node .meta{color:#666;font-size:.85em}
.badge{display:inline-block;padding:0 .4em;border-radius:4px;color:#fff;font-size:.8em}
table{border-collapse:collapse;margin-top:1em}td,th{border:1px solid #ccc;padding:.2em .5em}
"""


def _node_html(
    call: Mapping[str, Any], owner_row: Mapping[str, int], classification: Mapping[str, str]
) -> str:
    row = owner_row.get(call["call_id"])
    colour = ROW_COLOURS[row % len(ROW_COLOURS)] if row is not None else "#ccc"
    badge = (
        f'<span class="badge" style="background:{colour}">row {row}</span>'
        if row is not None
        else '<span class="badge" style="background:#999">no loss</span>'
    )
    seqs = f"seq {call['admitted_seq']}→{call.get('completed_seq') or '…'}"
    tokens = f"{len(call['prompt_token_ids'])}+{len(call['completion_token_ids'])} tok"
    cls = classification.get(call["call_id"], "?")
    return (
        f'<span class="node" style="border-color:{colour}">{badge} '
        f"<b>{html.escape(agent_label(call))}</b> · {html.escape(call['role'])} · "
        f"{html.escape(call['status'])} · {html.escape(cls)}<br>"
        f'<span class="meta">{html.escape(call["call_id"])} · {seqs} · {tokens}</span></span>'
    )


def forest_html(
    bundle: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    accounting: Mapping[str, Any],
    parents: Mapping[str, str | None],
) -> str:
    """A self-contained page: the forest as nested lists (edges = parent links), rows coloured."""
    calls = {c["call_id"]: c for c in bundle["calls"]}
    owner_row = {
        span["call_id"]: i for i, row in enumerate(rows) for span in row["spans"] if span["owned"]
    }
    classification = accounting.get("classification", {})
    children: dict[str | None, list[str]] = {}
    for call_id, parent in parents.items():
        children.setdefault(parent, []).append(call_id)
    for kids in children.values():
        kids.sort(key=lambda c: calls[c]["admitted_seq"])

    def subtree(parent: str | None, top: bool = False) -> str:
        items = "".join(
            f"<li>{_node_html(calls[c], owner_row, classification)}{subtree(c)}</li>"
            for c in children.get(parent, [])
        )
        return f'<ul class="tree{" top" if top else ""}">{items}</ul>' if items else ""

    others = [c for c in bundle["calls"] if c["call_id"] not in parents]
    other_html = "".join(f"<li>{_node_html(c, owner_row, classification)}</li>" for c in others)
    row_lines = "".join(
        f'<tr><td><span class="badge" style="background:{ROW_COLOURS[i % len(ROW_COLOURS)]}">'
        f"row {i}</span></td><td>{html.escape(row['row_id'])}</td><td>{len(row['input_ids'])}</td>"
        f"<td>{sum(row['loss_mask'])}</td>"
        f"<td>{html.escape(', '.join(s['call_id'] for s in row['spans'] if s['owned']))}</td></tr>"
        for i, row in enumerate(rows)
    )
    title = html.escape(f"episode {bundle['episode_id']} (group {bundle['group_id']})")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
        f"<p>reward {bundle.get('reward')} · status {html.escape(str(bundle['status']))} · "
        f"{len(bundle['calls'])} calls · counts {html.escape(str(accounting.get('counts')))}</p>"
        f"<h2>Forest of contexts</h2><p>Each node is a call; a child continues its parent's exact "
        f"tokens. The colour is the row that owns (trains) the call's generation.</p>"
        f"{subtree(None, top=True)}"
        + (f"<h2>Calls outside the forest</h2><ul>{other_html}</ul>" if others else "")
        + "<h2>Rows</h2><table><tr><th></th><th>row id</th><th>tokens</th><th>owned</th>"
        f"<th>owns the generations of</th></tr>{row_lines}</table></body></html>"
    )


def write_html(path: Path, page: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
