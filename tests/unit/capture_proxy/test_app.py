"""The app in-process (``httpx.ASGITransport``, the fake engine as an ``httpx.MockTransport``).

Pins the layout's contracts at the HTTP boundary: the bundle is the shared format, the status read
builds its drift report from per-call summaries without loading a token, and closing takes the
REST body's values as a domain request.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from capture_contracts.bundle import SCHEMA, parse_bundle
from capture_contracts.drift import bundle_drift, drift_report
from tests.support.inproc import passthrough_settings, served

TOKEN_COLUMNS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with served(passthrough_settings(tmp_path)) as (http, _app):
        yield http


async def _turns(client: httpx.AsyncClient, episode: str) -> list[dict[str, Any]]:
    """Two calls of one agent; the second continues the first (its messages + the reply)."""
    url = f"/episodes/{episode}/v1/chat/completions"
    headers = {"X-Agent-Id": "a"}
    first = [{"role": "user", "content": "hello"}]
    one = (await client.post(url, json={"model": "m", "messages": first}, headers=headers)).json()
    second = [*first, one["choices"][0]["message"], {"role": "user", "content": "more"}]
    two = await client.post(url, json={"model": "m", "messages": second}, headers=headers)
    assert two.status_code == 200
    return [one, two.json()]


async def test_status_read_reports_drift_without_loading_tokens(
    client: httpx.AsyncClient,
) -> None:
    episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
    await _turns(client, episode)
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", seen)
    try:
        status = (await client.get(f"/episodes/{episode}")).json()
    finally:
        event.remove(Engine, "before_cursor_execute", seen)
    assert statements, "the status read ran no statement"
    assert not [s for s in statements if any(column in s for column in TOKEN_COLUMNS)]
    bundle = (await client.get(f"/episodes/{episode}/bundle")).json()
    assert bundle["schema"] == SCHEMA
    report = status["continuation"]
    # The per-call summary kept at completion equals what the bundle's tokens say.
    assert report == drift_report(bundle_drift(parse_bundle(bundle)))
    assert report["continuations"] == 1 and report["fresh"] == {
        "no_previous_call": 1,
        "passthrough_mode": 1,
    }
    # The fake engine renders the JSON of the messages: the history is not a token prefix.
    assert report["token_prefix_continuations"] == 0


async def test_close_takes_the_body_as_a_domain_request(client: httpx.AsyncClient) -> None:
    episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
    await _turns(client, episode)
    calls = [c["call_id"] for c in (await client.get(f"/episodes/{episode}/calls")).json()]
    both = await client.post(
        f"/episodes/{episode}/close",
        json={"reward": 1.0, "discarded_calls": calls[:1], "accepted_calls": calls[:1]},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "accepted_calls"
    closed = await client.post(
        f"/episodes/{episode}/close", json={"reward": 0.5, "discarded_calls": calls[:1]}
    )
    assert closed.status_code == 200 and closed.json()["status"] == "closed"
    bundle = parse_bundle((await client.get(f"/episodes/{episode}/bundle")).json())
    assert [c.mark for c in bundle.calls] == ["discarded", None]
    assert bundle.reward == 0.5 and bundle.metadata == {}


async def test_the_served_app_freezes_what_its_startup_made(tmp_path: Path) -> None:
    """``capture-proxy serve`` moves the startup's objects out of the collector's sight (a full
    collection walked all of them: ~95 ms on the loop); an app made for tests does not."""
    gc.unfreeze()
    try:
        for freeze in (False, True):
            async with served(passthrough_settings(tmp_path), freeze_startup_heap=freeze):
                assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()
