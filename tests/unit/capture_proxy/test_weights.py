"""The served policy version (capture_proxy/weights.py, api/weights.py), in-process.

A call records the version at which it passed the gate; a pause waits for in-flight calls and
holds new ones (not failed) until resume names the next version; the grammar of a constrained
request is recorded with the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_proxy.app import create_app
from capture_proxy.capture import request_constraint
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings, WeightSettings
from capture_proxy.weights import WeightGate, version_of
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        store=StoreSettings(url=sqlite_url(tmp_path / "capture.db")),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
        weights=WeightSettings(initial_version=3),
    )
    app = create_app(settings, upstream_transport=fake_engine.transport(), migrate=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as http,
    ):
        yield http


async def _episode(client: httpx.AsyncClient) -> str:
    return str((await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"])


async def _call(client: httpx.AsyncClient, episode: str, **body: Any) -> httpx.Response:
    url = f"/episodes/{episode}/v1/chat/completions"
    return await client.post(url, json={"model": "m", "messages": MESSAGES, **body})


async def _versions(client: httpx.AsyncClient, episode: str) -> list[int | None]:
    bundle = (await client.get(f"/episodes/{episode}/bundle")).json()
    return [c.get("weight_version") for c in bundle["calls"]]


async def test_calls_record_the_version_that_served_them(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    assert (await _call(client, episode)).status_code == 200
    assert (await client.post("/weights/pause")).json()["paused"] is True
    # The fake engine has no /weight_info: the proxy's own counter goes on (3 → 4).
    resumed = (await client.post("/weights/resume")).json()
    assert resumed == {"weight_version": 4, "paused": False, "in_flight": 0, "held": 0}
    assert (await _call(client, episode)).status_code == 200
    await client.post("/weights/pause")
    assert (await client.post("/weights/resume", json={"weight_version": 9})).status_code == 200
    assert (await _call(client, episode)).status_code == 200
    assert await _versions(client, episode) == [3, 4, 9]


async def test_a_pause_holds_new_calls_and_does_not_fail_them(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    await client.post("/weights/pause")
    held = asyncio.create_task(_call(client, episode))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if (await client.get("/weights")).json()["held"] == 1:
            break
    state = (await client.get("/weights")).json()
    assert state == {"weight_version": 3, "paused": True, "in_flight": 0, "held": 1}
    status = (await client.get(f"/episodes/{episode}")).json()
    assert status["calls"]["admitted"] == 0  # held before admission
    assert not held.done()
    await client.post("/weights/resume", json={"weight_version": 7})
    assert (await held).status_code == 200
    assert await _versions(client, episode) == [7]


async def test_a_pause_waits_for_calls_in_flight(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    slow = asyncio.create_task(_call(client, episode, model="fake-slow", stream=True))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if (await client.get("/weights")).json()["in_flight"] == 1:
            break
    refused = await client.post("/weights/pause", json={"timeout_s": 0.01})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "weights_busy"
    assert (await client.get("/weights")).json()["paused"] is False  # reopened
    paused = await client.post("/weights/pause", json={"timeout_s": 30})
    assert paused.json()["in_flight"] == 0
    # The pause answered once the call had finished: its completion is committed.
    assert (await client.get(f"/episodes/{episode}")).json()["calls"]["completed"] == 1
    assert (await slow).status_code == 200
    await client.post("/weights/resume")


async def test_resume_and_pause_refuse_out_of_order(client: httpx.AsyncClient) -> None:
    assert (await client.post("/weights/resume")).status_code == 409
    await client.post("/weights/pause")
    assert (await client.post("/weights/pause")).status_code == 409
    older = await client.post("/weights/resume", json={"weight_version": 1})
    assert older.status_code == 409 and older.json()["error"]["param"] == "weight_version"
    assert (await client.post("/weights/resume", json={"weight_version": "5"})).status_code == 400


async def test_a_forgotten_pause_expires() -> None:
    gate = WeightGate(2, hold_limit_s=0.05)
    await gate.pause(1.0)
    assert await asyncio.wait_for(gate.enter(), timeout=5.0) == 2
    gate.leave()


async def test_constrained_calls_are_recorded(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    await _call(client, episode, structured_outputs={"regex": "yes|no"})
    await _call(client, episode)
    bundle = (await client.get(f"/episodes/{episode}/bundle")).json()
    assert [c.get("constraint") for c in bundle["calls"]] == ["regex", None]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"structured_outputs": {"regex": "a+"}}, "regex"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "json"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
        ({"guided_grammar": "root ::= 'a'"}, "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json"),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, None),
        ({"tools": TOOLS, "tool_choice": "none"}, None),
        ({}, None),
    ],
)  # fmt: skip
def test_request_constraint(body: dict[str, Any], kind: str | None) -> None:
    assert request_constraint(body) == kind


@pytest.mark.parametrize(
    ("value", "expected"), [("7", 7), (7, 7), ("default", None), (True, None), (-1, None)]
)
def test_engine_versions(value: object, expected: int | None) -> None:
    assert version_of(value) == expected
