"""Idle client connections outlive the clients' own keep-alive expiry (found by the load test).

uvicorn closes an idle connection after 5 s by default, the same 5 s httpx (and so the OpenAI
SDKs) keeps one in its pool: a call sent on a connection idle for about that long can meet the
proxy closing it, and the harness sees the connection drop (``httpx.ReadError``) — under load,
where a client's event loop lags, often enough to fail one call in a few hundred.
``capture-proxy serve`` keeps idle connections ``keep_alive_s`` (75 s).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.fixtures.db import sqlite_url
from tests.support import processes
from tests.support.processes import Process


def test_an_idle_connection_outlives_the_clients_expiry(tmp_path: Path, engine: Process) -> None:
    """A harness's pooled connection, idle past httpx's 5 s, carries its next call."""
    proxy = processes.proxy(tmp_path, sqlite_url(tmp_path / "capture.db"), engine.url).start()
    try:
        limits = httpx.Limits(keepalive_expiry=60)  # the client keeps it: only the proxy may not
        with httpx.Client(base_url=proxy.url, limits=limits, timeout=10) as client:
            created = client.post("/episodes", json={"group_id": "g", "episode_id": "ep-idle"})
            assert created.status_code == 201
            first = created.extensions["network_stream"].get_extra_info("client_addr")
            time.sleep(6.0)
            body = {"model": "fake", "messages": [{"role": "user", "content": "after a pause"}]}
            reply = client.post("/episodes/ep-idle/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.extensions["network_stream"].get_extra_info("client_addr") == first
    finally:
        proxy.stop()
