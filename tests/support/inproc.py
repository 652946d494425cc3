"""The proxy app in-process for unit tests: the fake engine (or a handler wrapping it) as an
``httpx.MockTransport`` upstream, the app behind an ``httpx.ASGITransport`` client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from capture_proxy.app import create_app
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url

EngineHandler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def passthrough_settings(tmp_path: Path) -> Settings:
    """A migrated SQLite store in ``tmp_path``, the fake engine's URL, passthrough continuation."""
    return Settings(
        store=StoreSettings(url=sqlite_url(tmp_path / "capture.db")),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
    )


@contextlib.asynccontextmanager
async def served(
    settings: Settings, engine: EngineHandler = fake_engine.handler, **app_options: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """The app started (its lifespan run) and a client to it (``app_options``: create_app's)."""
    app = create_app(
        settings, upstream_transport=httpx.MockTransport(engine), migrate=False, **app_options
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as http,
    ):
        yield http, app
