"""A real ``capture-proxy serve --admin-key`` process in front of the real vLLM (tiny model).

Over real HTTP: the admin key guards the episode API, each episode's key opens its own OpenAI
routes only (``Authorization: Bearer`` or ``x-api-key``), a token id outside the engine's
vocabulary (asked of vLLM itself) is refused before admission, and a body declared over
``limits.max_body_bytes`` is answered 413 while its bytes were never sent. And the start-up rule:
no admin key, no address but loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from tests.fixtures.proxy import free_port

pytestmark = pytest.mark.vllm

ADMIN = "integration-admin-key-7f3a9c1e"
TINY_VOCAB = 4096  # the tiny model's vocabulary (capture_devkit/tiny_model.py)
BODY_LIMIT = 1024 * 1024


def _serve(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "capture_proxy.cli", "serve", *args],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.fixture(scope="module")
def served(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    work = tmp_path_factory.mktemp("served")
    port = free_port()
    db = f"sqlite+aiosqlite:///{work / 'capture.db'}"
    proc = _serve(
        ["--port", str(port), "--db", db, "--upstream", vllm_server.base_url, "--admin-key", ADMIN],
        cwd=work,
        env={"CAPTURE_PROXY_LIMITS__MAX_BODY_BYTES": str(BODY_LIMIT)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url, proc
    finally:
        log = _stop(proc)
        # no key ever reaches the log (the episode keys are checked by the tests below)
        assert ADMIN not in log


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def _create(url: str, episode_id: str) -> str:
    created = httpx.post(
        f"{url}/episodes", json={"group_id": "g", "episode_id": episode_id}, headers=_admin()
    )
    assert created.status_code == 201, created.text
    key: str = created.json()["api_key"]
    return key


def _chat(vllm: VLLMServer) -> dict[str, Any]:
    return {
        "model": vllm.served_model_name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }


def _admitted(url: str, episode_id: str) -> int:
    status = httpx.get(f"{url}/episodes/{episode_id}", headers=_admin()).json()
    count: int = status["calls"]["admitted"]
    return count


def test_keys_over_http(served: tuple[str, subprocess.Popen[str]], vllm_server: VLLMServer) -> None:
    url, _ = served
    no_key = httpx.post(f"{url}/episodes", json={"group_id": "g"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/episodes").status_code == 401
    key_a, key_b = _create(url, "ep-a"), _create(url, "ep-b")
    assert key_a != key_b
    body = _chat(vllm_server)
    chat_a = f"{url}/episodes/ep-a/v1/chat/completions"
    bearer = httpx.post(chat_a, json=body, headers={"Authorization": f"Bearer {key_a}"}, timeout=60)
    assert bearer.status_code == 200, bearer.text
    assert bearer.json()["choices"][0]["message"]["role"] == "assistant"
    anthropic_style = httpx.post(chat_a, json=body, headers={"x-api-key": key_a}, timeout=60)
    assert anthropic_style.status_code == 200
    by_header = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"X-Episode-Id": "ep-a", "Authorization": f"Bearer {key_a}"},
        timeout=60,
    )
    assert by_header.status_code == 200
    # episode B's key neither writes to nor reads episode A; an episode key is no admin key
    for headers in ({"Authorization": f"Bearer {key_b}"}, {"x-api-key": key_b}, {}):
        refused = httpx.post(chat_a, json=body, headers=headers, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["message"]
    assert httpx.get(f"{url}/episodes/ep-a/bundle", headers={"x-api-key": key_a}).status_code == 401
    bundle_b = httpx.get(
        f"{url}/episodes/ep-a/bundle", headers={"Authorization": f"Bearer {key_b}"}
    )
    assert bundle_b.status_code == 401
    assert _admitted(url, "ep-a") == 3 and _admitted(url, "ep-b") == 0
    bundle = httpx.get(f"{url}/episodes/ep-a/bundle", headers=_admin()).json()
    assert [c["status"] for c in bundle["calls"]] == ["completed"] * 3
    closed = httpx.post(f"{url}/episodes/ep-a/close", json={"reward": 1.0}, headers=_admin())
    assert closed.status_code == 200 and closed.json()["status"] == "closed"


def test_out_of_vocabulary_ids_are_refused_before_admission(
    served: tuple[str, subprocess.Popen[str]], vllm_server: VLLMServer
) -> None:
    url, _ = served
    key = _create(url, "ep-vocab")
    headers = {"Authorization": f"Bearer {key}"}
    completions = f"{url}/episodes/ep-vocab/v1/completions"
    base = {"model": vllm_server.served_model_name, "max_tokens": 2}
    served_ok = httpx.post(
        completions, json={**base, "prompt": [1, TINY_VOCAB - 1]}, headers=headers, timeout=120
    )
    assert served_ok.status_code == 200, served_ok.text
    for prompt in ([1, TINY_VOCAB], [-3, 5], [[TINY_VOCAB + 10]]):
        refused = httpx.post(completions, json={**base, "prompt": prompt}, headers=headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "prompt"
    too_many = httpx.post(completions, json={**base, "prompt": "hi", "n": 17}, headers=headers)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert _admitted(url, "ep-vocab") == 1  # only the request that was served


def test_a_declared_oversized_body_is_answered_unread(
    served: tuple[str, subprocess.Popen[str]],
) -> None:
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    key = _create(url, "ep-big")
    declared = 64 * 1024 * 1024
    request = (
        "POST /episodes/ep-big/v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        '{"messages": ['
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)  # 64 MiB declared, a dozen bytes sent: the answer comes anyway
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(payload)["error"]["code"] == "body_too_large"
    streamed = httpx.post(
        f"{url}/episodes/ep-big/v1/chat/completions",
        content=iter([b"x" * 65536] * (BODY_LIMIT // 65536 + 2)),  # chunked, no length
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    assert streamed.status_code == 413
    assert _admitted(url, "ep-big") == 0


# -- start-up -----------------------------------------------------------------------------------


def test_listening_beyond_loopback_needs_an_admin_key(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'capture.db'}"
    port = free_port()
    refused = _serve(["--host", "0.0.0.0", "--port", str(port), "--db", db], cwd=tmp_path)
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0 without an admin key" in lines[0]
    assert not (tmp_path / "capture.db").exists()  # refused before touching the store
    short = _serve(["--port", str(port), "--db", db, "--admin-key", "short"], cwd=tmp_path)
    out, _ = short.communicate(timeout=60)
    assert short.returncode == 2 and "at least 16 characters" in out and "short" not in out[-10:]
    keyed = _serve(
        ["--host", "0.0.0.0", "--port", str(port), "--db", db],
        cwd=tmp_path,
        env={"CAPTURE_PROXY_AUTH__ADMIN_KEY": ADMIN},
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", keyed)
        episodes = httpx.get(f"http://127.0.0.1:{port}/episodes")
        assert episodes.status_code == 401
    finally:
        _stop(keyed)
