"""Episode helpers shared by the harness tests: open, close, fetch, reconstruct, check.

Every scenario ends in :func:`check_episode`, which asserts the DESIGN §5 invariants on the real
capture: accounting adds up, each trained generation is owned exactly once, and every row's mask
covers exactly its owned spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from reconstruct import Reconstruction, Row, parse_bundle, reconstruct_episode
from reconstruct.invariants import invariant_violations


@dataclass(frozen=True, slots=True)
class Episode:
    episode_id: str
    base_url: str


def open_episode(proxy_url: str, group_id: str) -> Episode:
    reply = httpx.post(f"{proxy_url}/episodes", json={"group_id": group_id}, timeout=30)
    assert reply.status_code == 201, reply.text
    body = reply.json()
    return Episode(body["episode_id"], body["base_url"])


def close_episode(proxy_url: str, episode: Episode, reward: float) -> dict[str, Any]:
    reply = httpx.post(
        f"{proxy_url}/episodes/{episode.episode_id}/close",
        json={"reward": reward, "wait_s": 30},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    bundle = httpx.get(f"{proxy_url}/episodes/{episode.episode_id}/bundle", timeout=30)
    assert bundle.status_code == 200, bundle.text
    data: dict[str, Any] = bundle.json()
    return data


def call_infos(proxy_url: str, episode: Episode) -> list[dict[str, Any]]:
    reply = httpx.get(f"{proxy_url}/episodes/{episode.episode_id}/calls", timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    calls: list[dict[str, Any]] = body["calls"] if isinstance(body, dict) else body
    return calls


def continuation_report(proxy_url: str, episode: Episode) -> dict[str, Any]:
    """The episode's drift report (``GET /episodes/{id}`` → ``continuation``)."""
    reply = httpx.get(f"{proxy_url}/episodes/{episode.episode_id}", timeout=30)
    assert reply.status_code == 200, reply.text
    report: dict[str, Any] = reply.json()["continuation"]
    return report


def overlapping(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both calls were in flight at once: each was admitted before the other completed."""
    return bool(a["admitted_seq"] < b["completed_seq"] and b["admitted_seq"] < a["completed_seq"])


def row_of(result: Reconstruction, call_id: str) -> Row:
    """The row that owns ``call_id``'s generation."""
    owners = [row for row in result.rows for s in row.spans if s.call_id == call_id and s.owned]
    assert len(owners) == 1, f"{call_id} owned by {len(owners)} rows"
    return owners[0]


def check_episode(bundle: dict[str, Any]) -> Reconstruction:
    """Reconstruct and assert the invariants; return the result for scenario-specific checks."""
    result = reconstruct_episode(bundle)
    assert invariant_violations(parse_bundle(bundle), result) == []
    accounting = result.accounting
    assert sum(accounting.counts.values()) == len(bundle["calls"]) == accounting.n_calls
    trained = {c for c, cls in accounting.classification.items() if cls == "trained"}
    owned = [s.call_id for row in result.rows for s in row.spans if s.owned]
    assert sorted(owned) == sorted(trained), "each trained generation owned exactly once"
    for row in result.rows:
        mask = np.zeros(len(row.input_ids), dtype=np.int8)
        for span in row.spans:
            if span.owned:
                mask[span.start : span.end] = 1
        assert np.array_equal(row.loss_mask, mask)
    return result


def trains_only(row: Row, call_ids: set[str]) -> bool:
    """The row's loss falls only on these calls' generations: everything pasted between them (a
    worker's answer, a tool result) is prompt, masked."""
    owned = {s.call_id for s in row.spans if s.owned}
    gaps = np.ones(len(row.input_ids), dtype=bool)
    for span in row.spans:
        if span.owned:
            gaps[span.start : span.end] = False
    return owned <= call_ids and not row.loss_mask[gaps].any()
