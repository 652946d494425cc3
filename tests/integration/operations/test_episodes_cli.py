"""``capture-proxy episodes …`` against a running proxy (uvicorn) on the real vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from capture_contracts.bundle import SCHEMA
from capture_devkit.engine import VLLMServer, free_port
from capture_devkit.server_thread import ProxyThread
from capture_proxy.cli import main
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from tests.fixtures.db import sqlite_url


@pytest.fixture
def proxy_url(vllm_server: VLLMServer, tmp_path: Path) -> Iterator[str]:
    settings = Settings(
        port=free_port(),
        store=StoreSettings(url=sqlite_url(tmp_path / "capture.db")),
        upstream=UpstreamSettings(url=vllm_server.base_url),
    )
    with ProxyThread(settings) as proxy:
        yield proxy.url


def _episode(url: str, episode_id: str, calls: int) -> None:
    created = httpx.post(f"{url}/episodes", json={"group_id": "g", "episode_id": episode_id})
    assert created.status_code == 201
    for _ in range(calls):
        reply = httpx.post(
            f"{url}/episodes/{episode_id}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            headers={"X-Agent-Id": "solver"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> object:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_list_show_close_export(
    proxy_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _episode(proxy_url, "ep-a", calls=2)
    _episode(proxy_url, "ep-b", calls=0)
    url = ["--url", proxy_url]

    listed = _json(capsys, ["episodes", "list", *url, "--json"])
    assert [e["episode_id"] for e in listed] == ["ep-a", "ep-b"]  # type: ignore[attr-defined]
    assert main(["episodes", "list", *url]) == 0
    table = capsys.readouterr().out
    assert "ep-a" in table and "completed 2" in table and "2 episodes" in table

    shown = _json(capsys, ["episodes", "show", "ep-a", *url, "--json"])
    assert isinstance(shown, dict) and len(shown["call_list"]) == 2
    assert {c["agent_id"] for c in shown["call_list"]} == {"solver"}
    assert main(["episodes", "show", "ep-a", *url]) == 0
    text = capsys.readouterr().out
    assert shown["call_list"][0]["call_id"] in text
    assert f"viewer: {proxy_url}/episodes/ep-a/view" in text

    closed = _json(capsys, ["episodes", "close", "ep-a", "--reward", "0.5", *url, "--json"])
    assert isinstance(closed, dict) and closed["status"] == "closed" and closed["reward"] == 0.5
    open_only = _json(capsys, ["episodes", "list", "--status", "open", *url, "--json"])
    assert [e["episode_id"] for e in open_only] == ["ep-b"]  # type: ignore[attr-defined]

    out = tmp_path / "bundles"
    written = _json(
        capsys, ["episodes", "export", "ep-a", "ep-b", "--out", str(out), *url, "--json"]
    )
    assert isinstance(written, dict) and len(written["written"]) == 2
    bundle = json.loads((out / "ep-a.json").read_text())
    assert bundle["schema"] == SCHEMA and len(bundle["calls"]) == 2


def test_errors_are_one_line(proxy_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["episodes", "show", "nope", "--url", proxy_url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("capture-proxy episodes show: GET /episodes/nope")
    assert "404" in err[0]
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["episodes", "list", "--url", dead]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the proxy at" in err[0]
    _episode(proxy_url, "ep-c", calls=0)
    assert main(["episodes", "close", "ep-c", "--reward", "1", "--url", proxy_url]) == 0
    capsys.readouterr()
    assert main(["episodes", "close", "ep-c", "--reward", "0", "--url", proxy_url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "409" in err[0]


def test_healthcheck_command(proxy_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["healthcheck", "--url", proxy_url]) == 0
    assert main(["healthcheck", "--url", proxy_url, "--ready"]) == 0  # store and vLLM answer
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["healthcheck", "--url", dead]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"capture-proxy healthcheck: {dead}/healthz")
