"""Engine faults with a real engine process (issue 12, part 2).

The fake engine runs as its own server process (tests/support/stub_engine.py) so it can be killed
mid-stream, answer 500/400/429, hang past ``upstream.timeout_s`` and come back on the same port;
the real vLLM killed mid-stream is ``test_real_engine_killed_mid_stream``.
Each case: what the client sees (the status before the first byte; an error event in the stream
after it), what is recorded (``failed`` with the reason), other episodes keep being served, and the
proxy recovers by itself when the engine is back.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory, ProxyServer
from tests.support.processes import Process

MESSAGES = [{"role": "user", "content": "count the fruit"}]


def _episode(proxy: ProxyServer, episode_id: str) -> str:
    created = httpx.post(f"{proxy.url}/episodes", json={"group_id": "g", "episode_id": episode_id})
    assert created.status_code == 201, created.text
    return f"{proxy.url}/episodes/{episode_id}/v1/chat/completions"


def _body(model: str, stream: bool = False) -> dict[str, object]:
    return {"model": model, "messages": MESSAGES, "stream": stream}


def _only_call(proxy: ProxyServer, episode_id: str) -> dict[str, object]:
    [call] = [
        c
        for c in httpx.get(f"{proxy.url}/episodes/{episode_id}/calls").json()
        if c["status"] != "completed"
    ]
    return call  # type: ignore[no-any-return]


def _events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def _upstream_error(reply: httpx.Response, stream: bool) -> dict[str, Any]:
    """The engine's fault as the harness got it: a 502 before the first byte, or — the status
    gone out with the stream's start — the stream's last event, with no ``[DONE]``."""
    if stream:
        assert reply.status_code == 200
        events = _events(reply.content)
        assert "[DONE]" not in events
        error: dict[str, Any] = json.loads(events[-1])
    else:
        assert reply.status_code == 502
        error = reply.json()
    assert error["error"]["type"] == "upstream_error"
    return error


def _assert_served(proxy: ProxyServer, episode_id: str) -> None:
    """Another episode's call goes through while (or after) the fault."""
    reply = httpx.post(_episode(proxy, episode_id), json=_body("fake"), timeout=30)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("status", [500, 400, 429])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_answers_pass_through_and_fail_the_call(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory, status: int, stream: bool
) -> None:
    proxy = proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=engine.url)
    url = _episode(proxy, "ep-error")
    reply = httpx.post(url, json=_body(f"fake-error-{status}", stream), timeout=30)
    # The status is decided before the first byte: the engine's own, with an OpenAI error body.
    assert reply.status_code == status
    assert reply.json()["error"]["message"] == "fake engine failure"
    call = _only_call(proxy, "ep-error")
    assert call["status"] == "failed"
    assert str(call["error"]).startswith(f"upstream {status}")
    _assert_served(proxy, "ep-other")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_json_that_is_not_an_object_fails_the_call_with_502(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory, stream: bool
) -> None:
    proxy = proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=engine.url)
    url = _episode(proxy, "ep-shape")
    reply = httpx.post(url, json=_body("fake-not-an-object", stream), timeout=30)
    error = _upstream_error(reply, stream)
    if stream:  # (its first chunk was the one that is not an object)
        assert len(_events(reply.content)) == 1
    assert "not a JSON object" in error["error"]["message"]
    call = _only_call(proxy, "ep-shape")
    assert call["status"] == "failed"
    assert "not a JSON object" in str(call["error"])
    _assert_served(proxy, "ep-other")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_token_ids_that_are_not_integers_fail_the_call_with_502(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory, stream: bool
) -> None:
    """Sampled ids the store cannot keep (3.5) fail their call with the engine's fault — never a
    silent conversion, and never the store's writer: the next calls are recorded as ever."""
    proxy = proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=engine.url)
    url = _episode(proxy, "ep-ids")
    reply = httpx.post(url, json=_body("fake-bad-ids", stream), timeout=30)
    error = _upstream_error(reply, stream)
    assert "token ids are not 32-bit integers" in error["error"]["message"]
    call = _only_call(proxy, "ep-ids")
    assert call["status"] == "failed"
    assert "token ids are not 32-bit integers" in str(call["error"])
    _assert_served(proxy, "ep-other")  # alone in the process (its commit on the loop's thread)
    _assert_served(proxy, "ep-more")


def test_engine_killed_mid_stream_then_restarted(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=engine.url)
    url = _episode(proxy, "ep-killed")
    with httpx.stream("POST", url, json=_body("fake-slow", stream=True), timeout=30) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        received = next(chunks)
        engine.kill()  # kill -9 of the engine's process group, mid-stream
        received += b"".join(chunks)  # the proxy ends its stream properly
    events = _events(received)
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error"
    call = _only_call(proxy, "ep-killed")
    assert call["status"] == "failed" and "UpstreamError" in str(call["error"])

    # While the engine is down: a clear 502 before the first byte, the call recorded failed.
    down = httpx.post(_episode(proxy, "ep-down"), json=_body("fake"), timeout=30)
    assert down.status_code == 502 and down.json()["error"]["type"] == "upstream_error"
    assert _only_call(proxy, "ep-down")["status"] == "failed"

    engine.start()  # back on the same port: the proxy recovers by itself
    _assert_served(proxy, "ep-back")
    with httpx.stream(
        "POST", _episode(proxy, "ep-back-stream"), json=_body("fake", True), timeout=30
    ) as response:
        assert _events(response.read())[-1] == "[DONE]"


def test_engine_slower_than_the_read_timeout(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=engine.url,
        upstream={"timeout_s": 0.5},
    )
    # No answer at all: 504 before the first byte, whole or streamed.
    for episode_id, stream in (("ep-hang", False), ("ep-hang-stream", True)):
        reply = httpx.post(_episode(proxy, episode_id), json=_body("fake-hang", stream), timeout=30)
        assert reply.status_code == 504, reply.text
        assert reply.json()["error"]["type"] == "upstream_error"
        call = _only_call(proxy, episode_id)
        assert call["status"] == "failed" and "UpstreamTimeout" in str(call["error"])

    # Other episodes are served while a call hangs (it holds no lock on the proxy): the other
    # call's answer comes while the hanging one still waits for its timeout.
    patient = proxy_factory(
        sqlite_url(tmp_path / "patient.db"), upstream_url=engine.url, upstream={"timeout_s": 5.0}
    )
    hanging = threading.Thread(
        target=httpx.post,
        args=(_episode(patient, "ep-hang-2"),),
        kwargs={"json": _body("fake-hang"), "timeout": 30},
    )
    hanging.start()
    while not httpx.get(f"{patient.url}/episodes/ep-hang-2").json()["calls"]["in_flight"]:
        time.sleep(0.02)  # admitted, waiting on the engine
    _assert_served(patient, "ep-meanwhile")
    assert hanging.is_alive()
    hanging.join()


def test_stream_stalls_past_the_read_timeout(
    tmp_path: Path, engine: Process, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=engine.url,
        upstream={"timeout_s": 0.1},  # fake-slow sends a chunk every 0.2 s
    )
    url = _episode(proxy, "ep-stall")
    with httpx.stream("POST", url, json=_body("fake-slow", True), timeout=30) as response:
        assert response.status_code == 200  # the first chunk came in time
        events = _events(response.read())
    assert events[-1] != "[DONE]" and "timed out" in json.loads(events[-1])["error"]["message"]
    call = _only_call(proxy, "ep-stall")
    assert call["status"] == "failed" and "UpstreamTimeout" in str(call["error"])


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A port whose accept queue is full: a new connection's handshake never completes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(8):  # fill the accept queue (never accepted)
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    probe = socket.create_connection  # the queue is full once a connect stops completing
    try:
        probe(("127.0.0.1", port), timeout=0.3).close()
        raise AssertionError("the accept queue did not fill; no port to time out on")
    except TimeoutError:
        pass
    yield port
    for filler in fillers:
        filler.close()
    server.close()


def test_engine_unreachable_past_the_connect_timeout(
    tmp_path: Path, proxy_factory: ProxyFactory, unanswered_port: int
) -> None:
    proxy = proxy_factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=f"http://127.0.0.1:{unanswered_port}",
        upstream={"connect_timeout_s": 0.3, "timeout_s": 60},
    )
    began = time.monotonic()
    reply = httpx.post(_episode(proxy, "ep-connect"), json=_body("fake"), timeout=30)
    assert reply.status_code == 504 and time.monotonic() - began < 5
    call = _only_call(proxy, "ep-connect")
    assert call["status"] == "failed" and "timed out" in str(call["error"])


def test_real_engine_killed_mid_stream(
    tmp_path: Path, tiny_model_dir: Path, proxy_factory: ProxyFactory
) -> None:
    """The real vLLM process group killed while it streams (its restart costs another ~60 s of
    start-up here, so the recovery is shown with the fake engine above)."""
    server = VLLMServer(tiny_model_dir, log_path=tmp_path / "vllm.log").start()
    try:
        proxy = proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=server.base_url)
        url = _episode(proxy, "ep-vllm")
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "stream": True,
            "max_tokens": 400,
            "min_tokens": 400,  # long enough to be killed in the middle
        }
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            received = next(chunks)
            while received.count(b"data: ") < 5:
                received += next(chunks)
            assert server.process is not None
            os.killpg(server.process.pid, signal.SIGKILL)  # kill -9 of its process group
            received += b"".join(chunks)
        events = _events(received)
        assert events[-1] != "[DONE]"
        assert json.loads(events[-1])["error"]["type"] == "upstream_error"
        call = _only_call(proxy, "ep-vllm")
        assert call["status"] == "failed" and "UpstreamError" in str(call["error"]), call
        down = httpx.post(_episode(proxy, "ep-vllm-down"), json=_body("tiny"), timeout=30)
        assert down.status_code == 502
    finally:
        server.stop()  # reaps what is left of the group
