"""Schemathesis fuzzes every route of the app's own OpenAPI document, in-process.

The app runs with the fake engine (``httpx.MockTransport``) on a SQLite store built by the real
migrations, behind starlette's in-process test client (no socket). Bounded and deterministic: a
fixed seed, ``MAX_EXAMPLES`` generated cases per operation (valid and invalid ones), no stateful
phase. Every answer must be no 5xx, and its status, content type, headers and body must be those
the document declares. The OpenAI routes are pointed at one open episode (by path, or by
``X-Episode-Id``) so their bodies reach the capture path instead of a 404.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import settings
from pydantic import SecretStr
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.schemas import BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient

from capture_proxy.app import create_app
from capture_proxy.settings import (
    AuthSettings,
    LimitsSettings,
    Settings,
    StoreSettings,
    UpstreamSettings,
)
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url

MAX_EXAMPLES = 50
KEYED_EXAMPLES = 20  # the same routes again with access control on: keys, 401s
ADMIN = "fuzz-admin-key-0123456789abcdef"
SEED = 12
OPEN_EPISODE = "fuzz-open"
CLOSING_EPISODE = "fuzz-closing"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def _settings(store_url: str, admin_key: str | None = None) -> Settings:
    return Settings(
        store=StoreSettings(url=store_url),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
        limits=LimitsSettings(max_body_bytes=256 * 1024),
        auth=AuthSettings(admin_key=None if admin_key is None else SecretStr(admin_key)),
    )


def _schema(admin_key: str | None, max_examples: int) -> BaseSchema:
    # The document depends on the routes and the auth setting only: no store is touched here.
    document = create_app(_settings("sqlite+aiosqlite://", admin_key), migrate=False).openapi()
    config = {
        "seed": SEED,
        "generation": {"max-examples": max_examples},
        "phases": {"stateful": {"enabled": False}},
    }
    return schemathesis.openapi.from_dict(document, config=SchemathesisConfig.from_dict(config))


schema = _schema(None, MAX_EXAMPLES)
keyed_schema = _schema(ADMIN, KEYED_EXAMPLES)


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite store (tests/integration/capture_proxy/test_fuzz_postgres.py overrides
    it: the same fuzzing on PostgreSQL)."""
    return sqlite_url(tmp_path_factory.mktemp("fuzz") / "capture.db")


@pytest.fixture(scope="module")
def client(fuzz_store: str) -> Iterator[TestClient]:
    app = create_app(
        _settings(fuzz_store), upstream_transport=fake_engine.transport(), migrate=False
    )
    with TestClient(app, raise_server_exceptions=False) as http:
        for episode in (OPEN_EPISODE, CLOSING_EPISODE):
            created = http.post("/episodes", json={"group_id": "fuzz", "episode_id": episode})
            assert created.status_code == 201
        yield http


def _positive(case: schemathesis.Case) -> bool:
    return case.meta is None or "negative" not in str(case.meta.generation.mode).lower()


def _aim(case: schemathesis.Case) -> None:
    """Point the OpenAI routes (and the episode reads) at episodes that exist."""
    path = case.operation.path
    if path.startswith("/episodes/{episode_id}"):
        closing = path.endswith("/close")
        case.path_parameters = {
            **(case.path_parameters or {}),
            "episode_id": CLOSING_EPISODE if closing else OPEN_EPISODE,
        }
    if path.startswith("/v1/"):
        case.headers = {**(case.headers or {}), "X-Episode-Id": OPEN_EPISODE}


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
def test_every_route_answers_as_documented(case: schemathesis.Case, client: TestClient) -> None:
    if _positive(case):
        _aim(case)  # a generated (invalid) path or header stays as generated
    response = client.request(**case.as_transport_kwargs(base_url="http://testserver"))
    _reopen_weights(client, {})
    case.validate_response(response, checks=CHECKS)


def _reopen_weights(client: TestClient, headers: dict[str, str]) -> None:
    """A fuzzed POST /weights/pause holds every later call: reopen the gate after each case."""
    if client.get("/weights", headers=headers).json().get("paused"):
        assert client.post("/weights/resume", headers=headers).status_code == 200


def test_the_fuzzed_store_holds_only_settled_calls(client: TestClient, fuzz_store: str) -> None:
    """After the fuzzing (the test above, same module client): the generated bodies did reach
    the capture path, and every call they admitted reached a terminal state."""
    assert client.app.state.settings.store.url == fuzz_store  # type: ignore[attr-defined]
    status = client.get(f"/episodes/{OPEN_EPISODE}").json()
    assert status["calls"]["completed"] > 0, "the fuzzing never reached the engine"
    assert status["calls"]["in_flight"] == 0
    calls = client.get(f"/episodes/{OPEN_EPISODE}/calls").json()
    assert all(c["status"] in {"completed", "failed", "cancelled"} for c in calls)


# -- the same with access control on ---------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    """The app with an admin key, and the open episode's own key."""
    store_url = sqlite_url(tmp_path_factory.mktemp("fuzz-keyed") / "capture.db")
    app = create_app(
        _settings(store_url, ADMIN), upstream_transport=fake_engine.transport(), migrate=False
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(app, raise_server_exceptions=False) as http:
        keys = {}
        for episode in (OPEN_EPISODE, CLOSING_EPISODE):
            body = {"group_id": "fuzz", "episode_id": episode}
            created = http.post("/episodes", json=body, headers=admin)
            assert created.status_code == 201
            keys[episode] = created.json()["api_key"]
        yield http, keys[OPEN_EPISODE]


@keyed_schema.parametrize()
@settings(max_examples=KEYED_EXAMPLES, deadline=None, derandomize=True, database=None)
def test_every_route_answers_as_documented_with_keys(
    case: schemathesis.Case, keyed_client: tuple[TestClient, str]
) -> None:
    """Valid cases carry the right key (admin on the episode API; the episode's own key on its
    OpenAI routes, as Bearer by path and as x-api-key by header); invalid ones carry whatever was
    generated, mostly nothing: a 401 that must match the document too."""
    client, episode_key = keyed_client
    if _positive(case):
        _aim(case)
        path = case.operation.path
        if path.startswith("/v1/"):
            key = {"x-api-key": episode_key}
        elif "/v1/" in path:
            key = {"Authorization": f"Bearer {episode_key}"}
        else:
            key = {"Authorization": f"Bearer {ADMIN}"}
        case.headers = {**(case.headers or {}), **key}
    response = client.request(**case.as_transport_kwargs(base_url="http://testserver"))
    _reopen_weights(client, {"Authorization": f"Bearer {ADMIN}"})
    case.validate_response(response, checks=CHECKS)


def test_the_keyed_fuzzing_reached_the_engine(keyed_client: tuple[TestClient, str]) -> None:
    client, _ = keyed_client
    admin = {"Authorization": f"Bearer {ADMIN}"}
    status = client.get(f"/episodes/{OPEN_EPISODE}", headers=admin).json()
    assert status["calls"]["completed"] > 0 and status["calls"]["in_flight"] == 0
