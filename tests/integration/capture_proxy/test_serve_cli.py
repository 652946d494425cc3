"""``capture-proxy serve`` as an operator starts it: flags and CAPTURE_PROXY_* settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fixtures.proxy import free_port


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("capture-proxy serve did not become healthy")


def test_serve_with_flags_and_environment(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "served.db"
    env = {
        **os.environ,
        "CAPTURE_PROXY_STORE__URL": "sqlite+aiosqlite:///should-be-overridden-by-flag.db",
        "CAPTURE_PROXY_PUBLIC_URL": "http://proxy.example:9999",
        "CAPTURE_PROXY_UPSTREAM__OVERRIDES": '{"temperature": 1.0}',
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capture_proxy.cli",
            "serve",
            "--port",
            str(port),
            "--db",
            f"sqlite:///{db}",  # (the store adds its async driver)
            "--upstream",
            "http://127.0.0.1:9",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        created = httpx.post(f"{url}/episodes", json={"group_id": "g", "episode_id": "ep-1"})
        assert created.status_code == 201
        # the public URL setting from the environment shapes what harnesses are told
        assert created.json()["base_url"] == "http://proxy.example:9999/episodes/ep-1/v1"
        # the --upstream flag: nothing listens there, so the call is recorded failed (502)
        chat = httpx.post(
            f"{url}/episodes/ep-1/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 502 and chat.json()["error"]["type"] == "upstream_error"
        calls = httpx.get(f"{url}/episodes/ep-1/calls").json()
        assert [c["status"] for c in calls] == ["failed"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert db.exists()  # the --db flag won over the environment
    assert not (tmp_path / "should-be-overridden-by-flag.db").exists()


def _served_lines(tmp_path: Path, *flags: str) -> list[str]:
    """What ``serve`` printed while answering two requests (then stopped)."""
    port = free_port()
    argv = [sys.executable, "-m", "capture_proxy.cli", "serve", "--port", str(port)]
    argv += ["--db", f"sqlite+aiosqlite:///{tmp_path / 'log.db'}", *flags]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        assert httpx.get(f"{url}/episodes").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    return out.splitlines()


def test_the_access_log_is_on_by_default_and_off_on_request(tmp_path: Path) -> None:
    def requests(lines: list[str]) -> list[str]:
        return [line for line in lines if '"GET /episodes HTTP/1.1" 200' in line]

    assert len(requests(_served_lines(tmp_path))) == 1
    quiet = _served_lines(tmp_path, "--no-access-log")
    assert requests(quiet) == []
    assert any("Uvicorn running" in line for line in quiet)  # the rest of the log is kept
