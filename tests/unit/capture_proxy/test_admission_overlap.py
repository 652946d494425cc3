"""The engine starts on a call while its admission commits (issue 11: the commit's fsync is off
the call's path), and a refused admission aborts the engine's request and records nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures import fake_engine
from tests.support.inproc import passthrough_settings, served


class _Engine:
    """The fake engine, noting when a generation request reaches it and when one is aborted."""

    def __init__(self, hang: bool = False) -> None:
        self.reached = asyncio.Event()
        self.aborted = asyncio.Event()
        self.hang = hang

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/completions"):
            return await fake_engine.handler(request)
        self.reached.set()
        if not self.hang:
            return await fake_engine.handler(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.aborted.set()
            raise
        raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def _client(tmp_path: Path, engine: _Engine) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async with served(passthrough_settings(tmp_path), engine) as (http, app):
        yield http, app.state.service


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def test_the_engine_has_the_request_before_the_admission_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _Engine()
    async with _client(tmp_path, engine) as (client, service):
        admit = service.store.admit

        async def admit_after_the_engine_started(*args: Any) -> list[str]:
            # Forwarding only after the admission would wait here until the timeout.
            await asyncio.wait_for(engine.reached.wait(), 5)
            return list(await admit(*args))

        monkeypatch.setattr(service.store, "admit", admit_after_the_engine_started)
        episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
        url = f"/episodes/{episode}/v1/chat/completions"
        for body in (CHAT, {**CHAT, "stream": True}):
            engine.reached.clear()
            answer = await client.post(url, json=body)
            assert answer.status_code == 200, answer.text
        bundle = (await client.get(f"/episodes/{episode}/bundle")).json()
        assert [c["status"] for c in bundle["calls"]] == ["completed", "completed"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_admission_aborts_the_engine_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    engine = _Engine(hang=True)
    async with _client(tmp_path, engine) as (client, service):
        admit = service.store.admit
        episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]

        async def admit_after_a_close(*args: Any) -> list[str]:
            await asyncio.wait_for(engine.reached.wait(), 5)
            closed = await client.post(f"/episodes/{episode}/close", json={"reward": 0.0})
            assert closed.status_code == 200, closed.text
            return list(await admit(*args))  # refused: the episode is closed

        monkeypatch.setattr(service.store, "admit", admit_after_a_close)
        url = f"/episodes/{episode}/v1/chat/completions"
        answer = await client.post(url, json={**CHAT, "stream": stream})
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["type"] == "conflict_error"
        await asyncio.wait_for(engine.aborted.wait(), 5)
        bundle = (await client.get(f"/episodes/{episode}/bundle")).json()
        assert bundle["calls"] == []
