"""The episode viewer: one self-contained HTML page per episode (``GET /episodes/{id}/view``).

Pure: an :class:`~capture_contracts.bundle.EpisodeBundle` in, a string out; no JavaScript, no
framework. :func:`episode_view` decides what can be shown, :func:`render_page` draws it:

- a time axis of the episode-wide counter (``admitted_seq`` → ``completed_seq``: the only clock
  every proxy process agrees on), one lane per agent, every call a node spanning its admission to
  its completion, parent links (DESIGN §5 rule 2) as arrows from a parent's end to its child;
- a table of the calls: role, status, accounting class, parent, tokens and how the prompt was
  built (stitched onto exact tokens, or rendered fresh and why: the fallback reason);
- the rows (closed, reconstructable episodes only): each row's tokens in runs, the owned spans in
  the colour of the row, generations owned by another row hatched, prompt tokens grey.

For an open episode the calls and the parent links of its completed calls are shown (the links
are final: a parent completed before its child was admitted), rows are not: the rules that
discard retries and rollbacks look at later calls, so an open episode's rows are not settled.
The demo (``capture_devkit.demo``) writes this same page for each of its episodes.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from capture_contracts.bundle import CallRecord, EpisodeBundle
from capture_contracts.errors import FormatError
from capture_contracts.rows import Row
from reconstruct import reconstruct_episode
from reconstruct.errors import ReconstructionError
from reconstruct.forest import build_forest

#: One colour per row (cycled); a trained call's node takes the colour of the row that owns it.
#: No reds or oranges: those mean failed and cancelled.
ROW_COLOURS = ("#4e79a7", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7")
CLASS_COLOURS = {
    "conditioning_only": "#bab0ac",
    "discarded_retry": "#d7a1a1",
    "failed": "#c0392b",
    "cancelled": "#e67e22",
    "unresolved": "#ffffff",
}
STATUS_COLOURS = {"completed": "#7f9fc4", "admitted": "#ffffff", **CLASS_COLOURS}
#: Runs longer than this show their first and last ``_KEEP`` token ids only.
_MAX_RUN = 240
_KEEP = 80
_LANE_H = 54
_LEFT = 150


@dataclass(frozen=True, slots=True)
class EpisodeView:
    """What the page shows: the calls, their parent links, and the rows once they are settled."""

    bundle: EpisodeBundle
    parents: Mapping[str, str | None]  # completed calls only
    rows: tuple[Row, ...] = ()
    classification: Mapping[str, str] | None = None  # accounting class of every call
    note: str | None = None  # why there are no rows (open episode, refused reconstruction)


def episode_view(bundle: EpisodeBundle) -> EpisodeView:
    """Reconstruct a closed episode; for an open one (or a refused one) link the calls only."""
    note = None
    if bundle.status == "closed":
        try:
            result = reconstruct_episode(bundle)
        except (ReconstructionError, FormatError) as exc:
            note = f"reconstruction refused the episode: {exc.message}"
        else:
            return EpisodeView(
                bundle, result.parents, result.rows, dict(result.accounting.classification)
            )
    else:
        note = f"the episode is {bundle.status}: rows are built once it is closed"
    forest = build_forest(bundle.calls)
    parents = {
        call.call_id: None if p is None else forest.nodes[p].call_id
        for call, p in zip(forest.nodes, forest.parent, strict=True)
    }
    return EpisodeView(bundle, parents, note=note)


# -- drawing ---------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;
 background:#fff;max-width:1400px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:26px 0 8px}
.summary{color:#555;margin:0 0 8px}.note{background:#fff7e0;border:1px solid #e8d9a8;
 padding:6px 10px;border-radius:4px;display:inline-block}
svg text{font-size:11px;fill:#333}svg .lane-label{font-size:12px;font-weight:600}
svg .axis{stroke:#999}svg .tick{fill:#888;font-size:10px}
.call-node rect{stroke:#333;stroke-width:1}.call-node text{font-size:10px;fill:#111}
.parent-link{fill:none;stroke:#555;stroke-width:1.3}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;
 text-align:left;vertical-align:top}th{background:#f4f4f4}
.sw{display:inline-block;width:11px;height:11px;border:1px solid #555;margin-right:4px;
 vertical-align:-1px}
.legend span.item{margin-right:14px;font-size:12px}
.row{border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 10px}
.row h3{font-size:13px;margin:0 0 6px}.bar{display:flex;height:14px;margin:0 0 6px;
 border:1px solid #bbb}.bar span{display:block;height:100%}
.tokens{font-family:ui-monospace,Menlo,monospace;font-size:11px;line-height:1.7;
 word-break:break-word}
.seg{padding:1px 2px;border-radius:2px;margin-right:1px}.seg.prompt{background:#eee;color:#555}
.seg.owned{color:#fff}.seg.masked{color:#222;background:repeating-linear-gradient(45deg,
 #f2f2f2,#f2f2f2 4px,#dcdcdc 4px,#dcdcdc 8px);border-bottom:3px solid}
.elided{color:#888;font-style:italic}
"""


def _agent(call: CallRecord) -> str:
    return call.agent_id or "(unlabelled)"


def _short(call_id: str) -> str:
    return call_id[-6:]


@dataclass(frozen=True, slots=True)
class _Layout:
    """Positions on the time axis: x of a counter value, y of an agent's lane."""

    step: float
    lanes: Mapping[str, int]
    end_seq: int

    def x(self, seq: int) -> float:
        return _LEFT + seq * self.step

    def y(self, agent: str) -> float:
        return 30 + self.lanes[agent] * _LANE_H

    @property
    def width(self) -> float:
        return self.x(self.end_seq) + 30

    @property
    def height(self) -> float:
        return 30 + len(self.lanes) * _LANE_H + 10


def _layout(calls: Sequence[CallRecord]) -> _Layout:
    lanes: dict[str, int] = {}
    for call in sorted(calls, key=lambda c: c.admitted_seq):
        lanes.setdefault(_agent(call), len(lanes))
    end_seq = max((max(c.admitted_seq, c.completed_seq or 0) for c in calls), default=0) + 1
    step = max(14.0, min(48.0, 1100.0 / max(end_seq, 1)))
    return _Layout(step, lanes, end_seq)


def _owner_rows(rows: Sequence[Row]) -> dict[str, int]:
    return {span.call_id: i for i, row in enumerate(rows) for span in row.spans if span.owned}


def _fill(call: CallRecord, view: EpisodeView, owners: Mapping[str, int]) -> str:
    if call.call_id in owners:
        return ROW_COLOURS[owners[call.call_id] % len(ROW_COLOURS)]
    if view.classification is not None:
        return CLASS_COLOURS.get(view.classification.get(call.call_id, ""), "#dddddd")
    return STATUS_COLOURS.get(call.status, "#dddddd")


def _construction(call: CallRecord) -> str:
    record = call.continuation
    if record is None:
        return "—"
    if record.stitched:
        return f"stitched on {_short(record.base_call_id or '?')}"
    return f"fresh: {record.reason or 'unknown'}"


def _tooltip(call: CallRecord, view: EpisodeView) -> str:
    cls = view.classification.get(call.call_id, "") if view.classification else ""
    parts = [
        call.call_id,
        f"agent {_agent(call)}",
        f"role {call.role}",
        f"status {call.status}" + (f", {cls}" if cls else ""),
        f"seq {call.admitted_seq}→{call.completed_seq if call.completed_seq else '…'}",
        f"{len(call.prompt_token_ids)}+{len(call.completion_token_ids)} tokens",
        f"prompt: {_construction(call)}",
    ]
    if call.error:
        parts.append(f"error: {call.error}")
    return "\n".join(parts)


def _timeline(view: EpisodeView, owners: Mapping[str, int]) -> str:
    calls = view.bundle.calls
    layout = _layout(calls)
    parts = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{layout.width:.0f}" '
        f'height="{layout.height:.0f}" role="img" aria-label="calls by agent over time">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#555"/>'
        "</marker></defs>",
    ]
    axis_y = layout.height - 8
    parts.append(
        f'<line class="axis" x1="{_LEFT}" y1="{axis_y}" x2="{layout.x(layout.end_seq)}" '
        f'y2="{axis_y}"/>'
    )
    every = max(1, round(40 / layout.step))
    for seq in range(0, layout.end_seq + 1, every):
        parts.append(
            f'<text class="tick" x="{layout.x(seq):.1f}" y="{axis_y - 3}" '
            f'text-anchor="middle">{seq}</text>'
        )
    parts.append(f'<text class="tick" x="4" y="{axis_y - 3}">episode counter →</text>')
    for agent, lane in layout.lanes.items():
        y = layout.y(agent)
        shade = "#fafafa" if lane % 2 == 0 else "#f1f4f8"
        parts.append(
            f'<rect x="0" y="{y - 14}" width="{layout.width:.0f}" height="{_LANE_H - 4}" '
            f'fill="{shade}"/><text class="lane-label" x="6" y="{y + 5}">'
            f"{html.escape(agent[:20])}</text>"
        )
    by_id = {c.call_id: c for c in calls}
    for child_id, parent_id in view.parents.items():
        if parent_id is None:
            continue
        parent, child = by_id[parent_id], by_id[child_id]
        x1, y1 = layout.x(parent.completed_seq or parent.admitted_seq), layout.y(_agent(parent))
        x2, y2 = layout.x(child.admitted_seq), layout.y(_agent(child))
        mid = (x1 + x2) / 2
        parts.append(
            f'<path class="parent-link" data-parent="{html.escape(parent_id)}" '
            f'data-child="{html.escape(child_id)}" marker-end="url(#arrow)" '
            f'd="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"/>'
        )
    for index, call in enumerate(sorted(calls, key=lambda c: c.admitted_seq)):
        end = call.completed_seq if call.completed_seq is not None else layout.end_seq
        x, y = layout.x(call.admitted_seq), layout.y(_agent(call))
        width = max(layout.x(end) - x, 6.0)
        dash = ' stroke-dasharray="3,2"' if call.status == "admitted" else ""
        cls = view.classification.get(call.call_id, call.status) if view.classification else ""
        parts.append(
            f'<g class="call-node" data-call-id="{html.escape(call.call_id)}" '
            f'data-role="{call.role}" data-status="{call.status}" data-class="{cls}">'
            f"<title>{html.escape(_tooltip(call, view))}</title>"
            f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="{width:.1f}" height="20" rx="4" '
            f'fill="{_fill(call, view, owners)}"{dash}/>'
            f'<text x="{x + 3:.1f}" y="{y + 4:.1f}">#{index} {call.role[0].upper()}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _legend(view: EpisodeView) -> str:
    if view.classification is not None:
        items = [(ROW_COLOURS[0], "trained (colour = the row that owns it)")]
        items += [(c, k.replace("_", " ")) for k, c in CLASS_COLOURS.items()]
    else:  # no rows yet: colour by call status
        items = [(STATUS_COLOURS[k], k) for k in ("completed", "admitted", "failed", "cancelled")]
    swatches = "".join(
        f'<span class="item"><span class="sw" style="background:{c}"></span>{html.escape(t)}</span>'
        for c, t in items
    )
    return (
        f'<p class="legend">{swatches}<span class="item">node text: #order, role initial '
        "(P policy, C compaction, A auxiliary); arrow: parent → child (exact token prefix)"
        "</span></p>"
    )


def _calls_table(view: EpisodeView, owners: Mapping[str, int]) -> str:
    head = (
        "<tr><th>#</th><th>call</th><th>agent</th><th>role</th><th>status</th><th>class</th>"
        "<th>parent</th><th>seq</th><th>tokens (prompt+completion)</th><th>prompt built</th>"
        "<th>owner row</th><th>error</th></tr>"
    )
    lines = []
    for index, call in enumerate(sorted(view.bundle.calls, key=lambda c: c.admitted_seq)):
        parent = view.parents.get(call.call_id)
        cls = view.classification.get(call.call_id, "") if view.classification else "—"
        owner = owners.get(call.call_id)
        cells = (
            f"#{index}",
            call.call_id,
            _agent(call),
            call.role,
            call.status,
            cls,
            "root" if parent is None and call.status == "completed" else (parent or "—"),
            f"{call.admitted_seq}→{call.completed_seq if call.completed_seq else '…'}",
            f"{len(call.prompt_token_ids)}+{len(call.completion_token_ids)}",
            _construction(call),
            "—" if owner is None else f"row {owner}",
            call.error or "",
        )
        lines.append(
            f'<tr class="call" data-call-id="{html.escape(call.call_id)}">'
            + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
            + "</tr>"
        )
    return f'<table class="calls">{head}{"".join(lines)}</table>'


def _run_ids(ids: Sequence[int]) -> str:
    if len(ids) <= _MAX_RUN:
        return " ".join(map(str, ids))
    hidden = len(ids) - 2 * _KEEP
    return (
        " ".join(map(str, ids[:_KEEP]))
        + f' <span class="elided">… {hidden} tokens …</span> '
        + " ".join(map(str, ids[-_KEEP:]))
    )


def _row_html(index: int, row: Row, owners: Mapping[str, int]) -> str:
    ids = row.input_ids.tolist()
    colour = ROW_COLOURS[index % len(ROW_COLOURS)]
    runs: list[tuple[int, int, str, str]] = []  # start, end, kind, css colour
    at = 0
    for span in sorted(row.spans, key=lambda s: s.start):
        if span.start > at:
            runs.append((at, span.start, "prompt", "#eeeeee"))
        if span.owned:
            runs.append((span.start, span.end, "owned", colour))
        else:
            other = owners.get(span.call_id)
            other_colour = "#999999" if other is None else ROW_COLOURS[other % len(ROW_COLOURS)]
            runs.append((span.start, span.end, "masked", other_colour))
        at = span.end
    if at < len(ids):
        runs.append((at, len(ids), "prompt", "#eeeeee"))
    total = max(len(ids), 1)
    bar = "".join(
        f'<span style="width:{100 * (end - start) / total:.3f}%;background:{c}" '
        f'title="{kind} {start}:{end}"></span>'
        for start, end, kind, c in runs
    )
    segs = "".join(
        f'<span class="seg {kind}" data-start="{start}" data-end="{end}" style="'
        + (f"background:{c}" if kind == "owned" else f"border-bottom-color:{c}")
        + f'">{_run_ids(ids[start:end])}</span>'
        for start, end, kind, c in runs
    )
    owned = int(row.loss_mask.sum())
    owns = ", ".join(_short(s.call_id) for s in row.spans if s.owned)
    return (
        f'<div class="row" data-row-id="{html.escape(row.row_id)}"><h3>'
        f'<span class="sw" style="background:{colour}"></span>row {index} · '
        f"{html.escape(row.row_id)} · {len(ids)} tokens, {owned} owned · owns {owns}</h3>"
        f'<div class="bar">{bar}</div><div class="tokens">{segs}</div></div>'
    )


def render_page(view: EpisodeView) -> str:
    """The whole page (a string of HTML, self-contained: inline CSS and SVG)."""
    bundle = view.bundle
    owners = _owner_rows(view.rows)
    counts: dict[str, int] = {}
    for value in (view.classification or {c.call_id: c.status for c in bundle.calls}).values():
        counts[value] = counts.get(value, 0) + 1
    title = f"episode {bundle.episode_id}"
    reward = "—" if bundle.reward is None else f"{bundle.reward:g}"
    summary = (
        f"group {bundle.group_id} · status {bundle.status} · reward {reward} · "
        f"{len(bundle.calls)} calls ("
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(counts.items()))
        + f") · {len(view.rows)} rows"
    )
    if view.rows:
        rows_html = (
            '<p class="legend"><span class="item"><span class="sw" style="background:#eee">'
            '</span>prompt (masked)</span><span class="item"><span class="sw" '
            'style="background:#4e79a7"></span>owned span (trained in this row)</span>'
            '<span class="item"><span class="sw" style="background:repeating-linear-gradient('
            '45deg,#f2f2f2,#f2f2f2 3px,#ccc 3px,#ccc 6px)"></span>generation owned by another '
            "row (masked here; underline = its row's colour)</span></p>"
            + "".join(_row_html(i, row, owners) for i, row in enumerate(view.rows))
        )
    else:
        rows_html = '<p class="note">no rows</p>'
    note = f'<p class="note">{html.escape(view.note)}</p>' if view.note else ""
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p class='summary'>{html.escape(summary)}</p>{note}"
        f"<h2>Calls by agent over time</h2>{_legend(view)}{_timeline(view, owners)}"
        f"<h2>Calls</h2>{_calls_table(view, owners)}"
        f"<h2>Rows</h2>{rows_html}</body></html>"
    )
