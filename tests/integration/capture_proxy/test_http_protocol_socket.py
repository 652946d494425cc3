"""uvicorn's real protocol with merged writes on a real socket: a JSON answer is one write of
the real transport, a stream's head reaches the client before its first chunk exists,
keep-alive and ``connection: close`` work, a client that leaves while the app waits is told to
the app's ``ClientWatch`` without a read of ``receive()`` (capture_proxy/http_protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from capture_proxy.http_protocol import LOST_CONNECTION, LostConnection, MergedWritesProtocol
from capture_proxy.responses import ClientWatch

REAL_WRITES: list[bytes] = []
FIRST_CHUNK = threading.Event()
#: /wait: what the app saw — the watch's verdict, and receive() calls after the body
WAITED: list[tuple[bool, int]] = []
WAITED_DONE = threading.Event()


class CountedProtocol(MergedWritesProtocol):
    """Records every write that reaches the real transport."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        write = transport.write

        def counted(data: Any) -> None:
            REAL_WRITES.append(bytes(data))
            write(data)

        transport.write = counted  # type: ignore[method-assign]
        super().connection_made(transport)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/json":
        body = b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"12")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    if scope["path"] == "/wait":  # an app waiting on something else (the engine) for 1 s at most
        assert isinstance(scope["extensions"][LOST_CONNECTION], LostConnection)
        await receive()  # the (empty) body
        reads = 0

        async def counted() -> Any:
            nonlocal reads
            reads += 1
            return await receive()

        left = asyncio.Event()
        watch = ClientWatch(scope, counted).start()
        watch.on_leave(left.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(left.wait(), 1.0)
        watch.stop()
        WAITED.append((watch.left, reads))
        WAITED_DONE.set()
        body = b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"12")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    # /stream: the head, then a chunk only once the test has seen the head
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    while not FIRST_CHUNK.is_set():
        await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


@pytest.fixture
def server() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=CountedProtocol, log_level="warning", lifespan="off"
    )
    served = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(served.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not served.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield port
    served.should_exit = True
    thread.join(timeout=10)


def _read_until(conn: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        data = conn.recv(65536)
        assert data, f"the connection closed before {marker!r}: {got!r}"
        got += data
    return got


def test_a_json_answer_is_one_write_and_keep_alive_holds(server: int) -> None:
    REAL_WRITES.clear()
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        for _ in range(2):  # two requests on one connection
            conn.sendall(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
            got = _read_until(conn, b'{"ok": true}')
            assert got.startswith(b"HTTP/1.1 200 OK\r\n")
        conn.sendall(b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        got = _read_until(conn, b'{"ok": true}')
        assert conn.recv(65536) == b""  # closed after the answer, which came whole
    answers = [w for w in REAL_WRITES if w.startswith(b"HTTP/1.1 200")]
    assert len(answers) == 3 and len(REAL_WRITES) == 3  # head and body: one write each time
    assert all(w.endswith(b'{"ok": true}') for w in answers)


def test_a_streams_head_is_not_held_for_its_first_chunk(server: int) -> None:
    REAL_WRITES.clear()
    FIRST_CHUNK.clear()
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        head = _read_until(conn, b"\r\n\r\n")  # while the app still waits to write a chunk
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"data:" not in head
        FIRST_CHUNK.set()
        rest = _read_until(conn, b"0\r\n\r\n")  # chunked encoding's end
    assert b"data: 1\n\n" in rest and b"data: [DONE]\n\n" in rest


@pytest.mark.parametrize("leaves", [True, False])
def test_a_client_that_leaves_is_told_to_the_waiting_app(server: int, leaves: bool) -> None:
    WAITED.clear()
    WAITED_DONE.clear()
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.sendall(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        if leaves:
            time.sleep(0.2)  # the app waits
            conn.close()
        else:  # stays: the app's wait ends by itself and it answers
            assert _read_until(conn, b'{"ok": true}').startswith(b"HTTP/1.1 200 OK\r\n")
        since = time.monotonic()
    assert WAITED_DONE.wait(5)
    if leaves:  # told at once, not at the end of the app's 1 s wait
        assert time.monotonic() - since < 0.5
    # never told when it stays; and no receive() was read for it: the protocol told the watch
    [seen] = WAITED
    assert seen == (leaves, 0)
