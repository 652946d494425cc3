"""The episode viewer's page, in-process: what it draws for closed, open and refused episodes.

The page is parsed with the standard library's HTML parser; the browser test
(tests/integration/capture_proxy/test_viewer_browser.py) checks the same elements in Chromium.
"""

from __future__ import annotations

import json
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from capture_contracts.bundle import parse_bundle
from capture_proxy.viewer import episode_view, render_page
from reconstruct import reconstruct_episode

GOLDEN = Path(__file__).parents[2] / "golden"


class _Elements(HTMLParser):
    """Counts elements by class and keeps their attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.by_class: dict[str, list[dict[str, str | None]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        for cls in (attributes.get("class") or "").split():
            self.by_class.setdefault(cls, []).append(attributes)


def _parse(page: str) -> _Elements:
    parser = _Elements()
    parser.feed(page)
    return parser


def _golden(name: str) -> dict[str, Any]:
    bundle: dict[str, Any] = json.loads((GOLDEN / f"{name}.json").read_text())["bundle"]
    return bundle


@pytest.mark.parametrize(
    "name", ["parent_workers_resume", "chain20_compaction", "failed_and_cancelled", "retried_call"]
)
def test_a_closed_episode_shows_every_call_link_and_row(name: str) -> None:
    bundle = parse_bundle(_golden(name))
    result = reconstruct_episode(bundle)
    page = _parse(render_page(episode_view(bundle)))
    nodes = page.by_class["call-node"]
    assert sorted(n["data-call-id"] or "" for n in nodes) == sorted(c.call_id for c in bundle.calls)
    classes = {n["data-call-id"]: n["data-class"] for n in nodes}
    assert classes == dict(result.accounting.classification)
    links = {(p["data-parent"], p["data-child"]) for p in page.by_class.get("parent-link", [])}
    assert links == {(p, c) for c, p in result.parents.items() if p is not None}
    rows = page.by_class.get("row", [])
    assert [r["data-row-id"] for r in rows] == [row.row_id for row in result.rows]
    # Every row's tokens are drawn in runs that cover it exactly once; owned runs = owned spans.
    runs = [(int(s["data-start"] or 0), int(s["data-end"] or 0)) for s in page.by_class["seg"]]
    assert sum(end - start for start, end in runs) == sum(len(r.input_ids) for r in result.rows)
    owned = sum(1 for _ in page.by_class.get("owned", []))
    assert owned == sum(1 for r in result.rows for s in r.spans if s.owned)
    assert len(page.by_class["call"]) == len(bundle.calls)  # the calls table


def test_an_open_episode_shows_calls_and_links_but_no_rows() -> None:
    data = _golden("parent_workers_resume")
    data["status"] = "open"
    bundle = parse_bundle(data)
    view = episode_view(bundle)
    page = render_page(view)
    parsed = _parse(page)
    assert len(parsed.by_class["call-node"]) == len(bundle.calls)
    assert "row" not in parsed.by_class
    assert "the episode is open: rows are built once it is closed" in page
    closed = reconstruct_episode(_golden("parent_workers_resume"))
    assert dict(view.parents) == dict(closed.parents)  # links are final before the close


def test_a_refused_episode_says_why() -> None:
    data = _golden("failed_and_cancelled")
    data["calls"][0] = {**data["calls"][0], "status": "admitted", "completed_seq": None}
    data["calls"][0].update(prompt_token_ids=data["calls"][0]["prompt_token_ids"])
    data["calls"][0].update(completion_token_ids=[], completion_logprobs=[], finish_reason=None)
    page = render_page(episode_view(parse_bundle(data)))
    assert "reconstruction refused the episode" in page and "unresolved call" in page
    statuses = Counter(n["data-status"] for n in _parse(page).by_class["call-node"])
    assert statuses["admitted"] == 1


def test_long_runs_are_elided_and_text_is_escaped() -> None:
    data = _golden("linear_chain")
    data["calls"][0]["agent_id"] = "<script>alert(1)</script>"
    data["calls"][0]["prompt_token_ids"] = list(range(1000))
    page = render_page(episode_view(parse_bundle(data)))
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "… 840 tokens …" in page
