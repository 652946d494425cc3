"""Access control in-process: the admin key, per-episode keys, 401 in OpenAI's shape.

The real ``capture-proxy serve`` process with ``--admin-key`` is exercised in
tests/integration/capture_proxy/test_access_serve.py.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from capture_proxy.api.auth import is_loopback, refusal_to_bind
from capture_proxy.app import create_app
from capture_proxy.settings import AuthSettings, Settings, StoreSettings, UpstreamSettings
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url

ADMIN = "admin-key-for-tests-0123456789"
HELLO = {"messages": [{"role": "user", "content": "hello"}]}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "capture.db"


@pytest.fixture
async def client(db_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        store=StoreSettings(url=sqlite_url(db_path)),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
        auth=AuthSettings(admin_key=SecretStr(ADMIN)),
    )
    app = create_app(settings, upstream_transport=fake_engine.transport(), migrate=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as http,
    ):
        yield http


def _unauthorized(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "authentication_error" and error["message"]
    return error


async def _episode(client: httpx.AsyncClient, episode_id: str) -> str:
    created = await client.post(
        "/episodes", json={"group_id": "g", "episode_id": episode_id}, headers=_bearer(ADMIN)
    )
    assert created.status_code == 201, created.text
    key: str = created.json()["api_key"]
    assert key.startswith("cpk_") and len(key) > 40
    return key


async def test_episode_management_needs_the_admin_key(client: httpx.AsyncClient) -> None:
    routes: list[tuple[str, str, Any]] = [
        ("POST", "/episodes", {"group_id": "g"}),
        ("GET", "/episodes", None),
        ("GET", "/episodes/ep", None),
        ("GET", "/episodes/ep/calls", None),
        ("GET", "/episodes/ep/bundle", None),
        ("PATCH", "/episodes/ep/calls/c", {"mark": "discarded"}),
        ("POST", "/episodes/ep/close", {"reward": 1.0}),
    ]
    key = await _episode(client, "ep")
    for method, path, body in routes:
        for headers in ({}, _bearer("wrong"), _bearer(key), {"x-api-key": ADMIN}):
            response = await client.request(method, path, json=body, headers=headers)
            assert _unauthorized(response)["code"] == "admin_key_required", (method, path)
    listed = await client.get("/episodes", headers=_bearer(ADMIN))
    assert listed.status_code == 200 and [e["episode_id"] for e in listed.json()] == ["ep"]
    assert all(e.get("api_key") is None for e in listed.json())  # shown once, at creation
    assert (await client.get("/episodes/ep", headers=_bearer(ADMIN))).status_code == 200


async def test_an_episode_key_opens_its_own_episode_only(client: httpx.AsyncClient) -> None:
    key_a, key_b = await _episode(client, "ep-a"), await _episode(client, "ep-b")
    url_a = "/episodes/ep-a/v1/chat/completions"
    assert (await client.post(url_a, json=HELLO, headers=_bearer(key_a))).status_code == 200
    assert (await client.post(url_a, json=HELLO, headers={"x-api-key": key_a})).status_code == 200
    by_header = await client.post(
        "/v1/chat/completions", json=HELLO, headers={"X-Episode-Id": "ep-a", "x-api-key": key_a}
    )
    assert by_header.status_code == 200
    models = await client.get("/episodes/ep-a/v1/models", headers=_bearer(key_a))
    assert models.status_code == 200
    # another episode's key, no key, a wrong key, an unknown episode: 401, nothing admitted
    for headers in (_bearer(key_b), {"x-api-key": key_b}, {}, _bearer("cpk_guess")):
        _unauthorized(await client.post(url_a, json=HELLO, headers=headers))
    _unauthorized(
        await client.post(
            "/v1/chat/completions", json=HELLO, headers={"X-Episode-Id": "ep-a", **_bearer(key_b)}
        )
    )
    _unauthorized(await client.get("/episodes/ep-a/v1/models", headers=_bearer(key_b)))
    _unauthorized(await client.get("/v1/models", headers=_bearer(key_a)))  # no episode named
    unknown = await client.post(
        "/episodes/nope/v1/chat/completions", json=HELLO, headers=_bearer(key_a)
    )
    _unauthorized(unknown)  # a key cannot probe which episodes exist
    # an episode key does not reach the episode API, even its own episode's
    _unauthorized(await client.get("/episodes/ep-a/bundle", headers=_bearer(key_a)))
    status = (await client.get("/episodes/ep-a", headers=_bearer(ADMIN))).json()
    assert status["calls"]["admitted"] == 3
    status_b = (await client.get("/episodes/ep-b", headers=_bearer(ADMIN))).json()
    assert status_b["calls"]["admitted"] == 0


async def test_the_admin_key_serves_any_episode(client: httpx.AsyncClient) -> None:
    await _episode(client, "ep")
    chat = await client.post("/episodes/ep/v1/chat/completions", json=HELLO, headers=_bearer(ADMIN))
    assert chat.status_code == 200
    assert (await client.get("/v1/models", headers=_bearer(ADMIN))).status_code == 200
    unknown = await client.post(
        "/episodes/nope/v1/chat/completions", json=HELLO, headers=_bearer(ADMIN)
    )
    assert unknown.status_code == 404  # the admin may know what does not exist


async def test_keys_are_stored_hashed_and_never_logged(
    client: httpx.AsyncClient, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = await _episode(client, "ep")
    await client.post("/episodes/ep/v1/chat/completions", json=HELLO, headers=_bearer(key))
    await client.post("/episodes/ep/v1/chat/completions", json=HELLO, headers=_bearer("cpk_bad"))
    with sqlite3.connect(db_path) as db:
        ((stored,),) = db.execute("SELECT api_key_hash FROM episodes").fetchall()
        dump = "\n".join(db.iterdump())
    assert stored == hashlib.sha256(key.encode()).hexdigest()
    assert key not in dump and ADMIN not in dump
    assert key not in caplog.text and ADMIN not in caplog.text


async def test_the_openapi_document_declares_the_keys(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    assert set(document["components"]["securitySchemes"]) == {
        "adminKey",
        "episodeKey",
        "episodeApiKey",
    }
    assert document["paths"]["/episodes"]["post"]["security"] == [{"adminKey": []}]
    chat = document["paths"]["/episodes/{episode_id}/v1/chat/completions"]["post"]
    assert {"episodeApiKey": []} in chat["security"] and "401" in chat["responses"]


# -- start-up: where the proxy may listen without a key ---------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("proxy.example", False),
    ],
)
def test_only_loopback_is_served_without_a_key(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    refusal = refusal_to_bind(Settings(host=host))
    assert (refusal is None) is loopback
    if refusal is not None:
        assert "\n" not in refusal and host in refusal and "--admin-key" in refusal
    keyed = Settings(host=host, auth=AuthSettings(admin_key=SecretStr(ADMIN)))
    assert refusal_to_bind(keyed) is None


def test_a_short_admin_key_is_refused() -> None:
    with pytest.raises(ValidationError, match="at least 16 characters"):
        AuthSettings(admin_key=SecretStr("short"))
    assert "short" not in repr(AuthSettings(admin_key=SecretStr("x" * 16)))
