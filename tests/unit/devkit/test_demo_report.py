"""The demo's per-episode figures (capture_devkit/demo_report.py): what it counts of a bundle."""

from __future__ import annotations

from typing import Any

from capture_devkit.demo_report import episode_figures


def _call(call_id: str, agent: str, continuation: dict[str, Any] | None) -> dict[str, Any]:
    call: dict[str, Any] = {"call_id": call_id, "agent_id": agent}
    if continuation is not None:
        call["continuation"] = continuation
    return call


def test_stitched_calls_are_counted_with_those_rendered_in_the_proxy() -> None:
    bundle = {
        "episode_id": "ep",
        "reward": 1.0,
        "calls": [
            _call("c1", "parent", {"stitched": False, "reason": "no_prior_call"}),
            _call("c2", "parent", {"stitched": True, "renders": 2}),  # the engine rendered
            _call("c3", "parent", {"stitched": True, "renders": 0}),  # rendered in the proxy
            _call("c4", "worker", {"stitched": True, "renders": 1}),
            _call("c5", "worker", None),  # a completions call: no record
        ],
    }
    accounting = {"counts": {"trained": 5, "refused": 0}, "row_tokens": 9, "reference_tokens": 9}
    parents = {"c1": None, "c2": "c1", "c3": "c2", "c4": None, "c5": "c4"}

    figures = episode_figures(bundle, [], accounting, parents)

    assert (figures.stitched, figures.rendered_here) == (3, 1)
    assert figures.to_dict()["stitched"] == 3 and figures.to_dict()["rendered_here"] == 1
    assert figures.calls_by_class == {"trained": 5}
    assert figures.continued_by_agent == {"parent": 2, "worker": 1}
    assert figures.fresh_by_agent == {"parent": 1, "worker": 1}
