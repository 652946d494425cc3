"""Bad input at the HTTP boundary: a 4xx in OpenAI's error shape, never a 500, nothing admitted.

The app runs in-process with the fake engine (which refuses out-of-vocabulary ids like vLLM).
After every rejected request the store is asked how many calls the episode holds: none.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from capture_proxy.app import create_app
from capture_proxy.engine_vocab import EngineVocabulary
from capture_proxy.settings import LimitsSettings, Settings, StoreSettings, UpstreamSettings
from capture_proxy.upstream import Upstream
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url

LIMIT = 4096
MAX_N = 4
EPISODE = "ep"
CHAT = f"/episodes/{EPISODE}/v1/chat/completions"
COMPLETIONS = f"/episodes/{EPISODE}/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


def _settings(store_url: str) -> Settings:
    return Settings(
        store=StoreSettings(url=store_url),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
        limits=LimitsSettings(max_body_bytes=LIMIT, max_n=MAX_N),
    )


@pytest.fixture
def bad_input_store(tmp_path: Path) -> str:
    """A migrated SQLite store (tests/integration/capture_proxy/test_bad_input_postgres.py runs
    the same tests on PostgreSQL, which refuses more: NUL, over-long strings)."""
    return sqlite_url(tmp_path / "capture.db")


@pytest.fixture
async def app(bad_input_store: str) -> AsyncIterator[FastAPI]:
    app = create_app(
        _settings(bad_input_store), upstream_transport=fake_engine.transport(), migrate=False
    )
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
        created = await http.post("/episodes", json={"group_id": "g", "episode_id": EPISODE})
        assert created.status_code == 201
        assert created.json()["api_key"] is None  # no admin key: open, no episode keys
        yield http


async def _admitted(client: httpx.AsyncClient, episode: str = "ep") -> int:
    count: int = (await client.get(f"/episodes/{episode}")).json()["calls"]["admitted"]
    return count


def _openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    return error


def _raw(text: str) -> bytes:
    return text.encode()


BAD_BODIES: list[tuple[str, str, bytes, str | None]] = [
    # (case, path, raw body, the param the error names)
    ("malformed JSON", CHAT, b'{"model": "m", "messages": [', None),
    ("invalid UTF-8", CHAT, b'{"model": "m\xff\xfe", "messages": []}', None),
    (
        "NaN",
        CHAT,
        _raw('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
        None,
    ),
    (
        "a number beyond a float",
        CHAT,
        _raw('{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}'),
        None,
    ),
    ("lone surrogate", CHAT, _raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'), None),
    ("not an object", CHAT, b"[1, 2]", None),
    ("messages not a list", CHAT, _raw('{"messages": "hello"}'), "messages"),
    ("message without role", CHAT, _raw('{"messages": [{"content": "x"}]}'), "messages"),
    ("max_tokens a word", CHAT, _raw(json.dumps({"messages": HELLO, "max_tokens": "many"})), None),
    ("stream a word", CHAT, _raw(json.dumps({"messages": HELLO, "stream": "yes"})), "stream"),
    ("n over the limit", CHAT, _raw(json.dumps({"messages": HELLO, "n": MAX_N + 1})), "n"),
    ("n zero", CHAT, _raw(json.dumps({"messages": HELLO, "n": 0})), "n"),
    ("model too long", CHAT, _raw(json.dumps({"model": "m" * 201, "messages": HELLO})), "model"),
    ("model with NUL", CHAT, _raw(json.dumps({"model": "m\u0000", "messages": HELLO})), "model"),
    ("no prompt", COMPLETIONS, _raw('{"model": "m"}'), "prompt"),
    ("negative token id", COMPLETIONS, _raw('{"prompt": [5, -1, 7]}'), "prompt"),
    (
        "out-of-vocabulary id",
        COMPLETIONS,
        _raw(f'{{"prompt": [5, {fake_engine.VOCAB_SIZE}]}}'),
        "prompt",
    ),
    ("huge token id", COMPLETIONS, _raw('{"prompt": [[99999999999]]}'), "prompt"),
    ("a batch of prompts", COMPLETIONS, _raw('{"prompt": ["a", "b"]}'), "prompt"),
    ("empty prompt list", COMPLETIONS, _raw('{"prompt": []}'), "prompt"),
    ("ids as words", COMPLETIONS, _raw('{"prompt": [1, "two"]}'), "prompt"),
]


@pytest.mark.parametrize(
    ("case", "path", "raw", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
async def test_bad_openai_bodies_are_400_and_admit_nothing(
    client: httpx.AsyncClient, case: str, path: str, raw: bytes, param: str | None
) -> None:
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    error = _openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert await _admitted(client) == 0


async def test_token_ids_inside_the_engine_vocabulary_are_served(
    client: httpx.AsyncClient,
) -> None:
    last = fake_engine.VOCAB_SIZE - 1
    served = await client.post(COMPLETIONS, json={"prompt": [0, 5, last]})
    assert served.status_code == 200, served.text
    refused = await client.post(COMPLETIONS, json={"prompt": [0, last + 1]})
    error = _openai_error(refused, 400)
    assert error["code"] == "token_id_out_of_vocabulary"
    assert f"ids 0 to {last}" in error["message"]
    assert await _admitted(client) == 1


async def test_n_up_to_a_raised_limit_is_served(tmp_path: Path) -> None:
    settings = _settings(sqlite_url(tmp_path / "raised.db"))
    settings = settings.model_copy(update={"limits": LimitsSettings(max_n=24)})
    app = create_app(settings, upstream_transport=fake_engine.transport(), migrate=False)
    transport = httpx.ASGITransport(app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://proxy") as http,
    ):
        await http.post("/episodes", json={"group_id": "g", "episode_id": EPISODE})
        served = await http.post(CHAT, json={"messages": HELLO, "n": 20})
        assert served.status_code == 200, served.text
        assert len(served.json()["choices"]) == 20
        _openai_error(await http.post(CHAT, json={"messages": HELLO, "n": 25}), 400)
        assert await _admitted(http) == 20


async def test_an_agent_id_too_long_for_the_store_is_400(client: httpx.AsyncClient) -> None:
    long = await client.post(CHAT, json={"messages": HELLO}, headers={"X-Agent-Id": "a" * 201})
    assert _openai_error(long, 400)["param"] == "X-Agent-Id"
    assert await _admitted(client) == 0


async def test_unknown_and_closed_episodes(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/episodes/nope/v1/chat/completions", json={"messages": HELLO})
    assert _openai_error(unknown, 404)["type"] == "not_found_error"
    by_header = await client.post(
        "/v1/chat/completions", json={"messages": HELLO}, headers={"X-Episode-Id": "nope"}
    )
    _openai_error(by_header, 404)
    no_header = await client.post("/v1/chat/completions", json={"messages": HELLO})
    assert _openai_error(no_header, 400)["param"] == "X-Episode-Id"
    bad_header = await client.post(
        "/v1/chat/completions", json={"messages": HELLO}, headers={"X-Episode-Id": "a b"}
    )
    _openai_error(bad_header, 400)
    assert (await client.post("/episodes/ep/close", json={"reward": 1.0})).status_code == 200
    closed = await client.post(CHAT, json={"messages": HELLO})
    assert _openai_error(closed, 409)["code"] == "episode_not_open"
    assert await _admitted(client) == 0


REST_CASES: list[tuple[str, str, str, Any, int]] = [
    ("unknown field on create", "POST", "/episodes", {"group_id": "g", "colour": "red"}, 400),
    ("group_id with NUL", "POST", "/episodes", {"group_id": "g\u0000"}, 400),
    ("bad episode id", "POST", "/episodes", {"group_id": "g", "episode_id": "a/b"}, 400),
    ("wrong type", "POST", "/episodes", {"group_id": 7}, 400),
    ("duplicate episode", "POST", "/episodes", {"group_id": "g", "episode_id": "ep"}, 409),
    ("unknown field on close", "POST", "/episodes/ep/close", {"reward": 1, "bonus": 2}, 400),
    ("reward a word", "POST", "/episodes/ep/close", {"reward": "high"}, 400),
    ("unknown episode", "GET", "/episodes/nope", None, 404),
    ("unknown episode calls", "GET", "/episodes/nope/calls", None, 404),
    ("unknown episode bundle", "GET", "/episodes/nope/bundle", None, 404),
    ("unknown call", "PATCH", "/episodes/ep/calls/call_nope", {"mark": "discarded"}, 404),
    ("unknown field on mark", "PATCH", "/episodes/ep/calls/c", {"mark": None, "x": 1}, 400),
    ("unknown mark", "PATCH", "/episodes/ep/calls/c", {"mark": "maybe"}, 400),
    ("bad status filter", "GET", "/episodes?status=sleeping", None, 400),
]


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "status"), REST_CASES, ids=[c[0] for c in REST_CASES]
)
async def test_bad_rest_requests_are_4xx_in_the_openai_shape(
    client: httpx.AsyncClient, case: str, method: str, path: str, body: Any, status: int
) -> None:
    response = await client.request(method, path, json=body)
    _openai_error(response, status)
    assert await _admitted(client) == 0


async def test_nan_in_rest_metadata_is_400(client: httpx.AsyncClient) -> None:
    raw = b'{"group_id": "g", "metadata": {"score": NaN}}'
    response = await client.post(
        "/episodes", content=raw, headers={"content-type": "application/json"}
    )
    _openai_error(response, 400)
    listed = (await client.get("/episodes")).json()
    assert [e["episode_id"] for e in listed] == ["ep"]


async def test_a_body_over_the_limit_is_413(client: httpx.AsyncClient) -> None:
    big = {"messages": [{"role": "user", "content": "x" * LIMIT}]}
    response = await client.post(CHAT, json=big)
    error = _openai_error(response, 413)
    assert error["code"] == "body_too_large" and str(LIMIT) in error["message"]
    assert response.headers["connection"] == "close"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 512 + 1):
            yield b"y" * 512
        yield b'"}]}'

    streamed = await client.post(CHAT, content=chunks())
    _openai_error(streamed, 413)
    rest = await client.post("/episodes", json={"group_id": "g", "metadata": {"x": "z" * LIMIT}})
    _openai_error(rest, 413)
    assert await _admitted(client) == 0
    assert len((await client.get("/episodes")).json()) == 1


# -- the 413 is answered without reading the rest ---------------------------------------------


async def _asgi(
    app: FastAPI, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[int, int]:
    """Drive the app with a body in chunks; the answer's status and how many chunks it read."""
    pulled = 0
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        if pulled > len(chunks):
            return {"type": "http.disconnect"}
        return {
            "type": "http.request",
            "body": chunks[pulled - 1],
            "more_body": pulled < len(chunks),
        }

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"proxy"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("proxy", 80),
        "state": {},
    }
    await app(scope, receive, send)
    return status[0], pulled


async def test_413_reads_no_byte_past_the_limit(app: FastAPI) -> None:
    chunks = [b"x" * 1024] * 64  # 64 KiB on offer, the limit is 4 KiB
    declared = [(b"content-length", str(64 * 1024).encode())]
    assert await _asgi(app, declared, chunks) == (413, 0)  # Content-Length: nothing read
    status, pulled = await _asgi(app, [], chunks)  # chunked: read until the limit is crossed
    assert status == 413 and pulled == LIMIT // 1024 + 1
    # A small length beside a transfer coding (a smuggling attempt, which the servers refuse):
    # the body is counted all the same, never trusted to the length.
    both = [(b"content-length", b"2"), (b"transfer-encoding", b"chunked")]
    status, pulled = await _asgi(app, both, chunks)
    assert status == 413 and pulled == LIMIT // 1024 + 1


# -- the engine's vocabulary -------------------------------------------------------------------


async def test_the_vocabulary_is_asked_of_the_engine_once() -> None:
    probes: list[dict[str, Any]] = []

    async def counting(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            probes.append(json.loads(request.content))
        return await fake_engine.handler(request)

    upstream = Upstream(
        UpstreamSettings(url="http://engine"), transport=httpx.MockTransport(counting)
    )
    vocabulary = EngineVocabulary(upstream)
    assert await vocabulary.size() == fake_engine.VOCAB_SIZE
    asked = len(probes)
    assert 2 <= asked <= 24 and all(p["max_tokens"] == 1 for p in probes)
    assert await vocabulary.size() == fake_engine.VOCAB_SIZE and len(probes) == asked  # cached
    assert await EngineVocabulary(upstream, configured=100).size() == 100
    assert len(probes) == asked  # a configured size asks nothing
    await upstream.aclose()


async def test_an_engine_that_cannot_tell_is_asked_again_later() -> None:
    down = True

    async def flaky(request: httpx.Request) -> httpx.Response:
        if down:
            raise httpx.ConnectError("engine down")
        return await fake_engine.handler(request)

    upstream = Upstream(UpstreamSettings(url="http://engine"), transport=httpx.MockTransport(flaky))
    vocabulary = EngineVocabulary(upstream)
    assert await vocabulary.size() is None
    down = False
    assert await vocabulary.size() == fake_engine.VOCAB_SIZE
    await upstream.aclose()
