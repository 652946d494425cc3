"""The socket transport over real loopback connections: keep-alive reuse, and when not to reuse.

A tiny HTTP/1.1 server writes a chunked SSE stream whose ``[DONE]`` and chunked end arrive in
separate writes (as a real engine's do, token by token): a reader that stops at ``[DONE]`` and
``finish()``es the response hands the connection back to the pool; one that leaves early (a
cancelled call) closes it, which is what aborts the engine's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from capture_proxy.upstream.client import SseBatches
from capture_proxy.upstream.transport import SocketTransport

_EVENTS = [b"data: {}\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"]


class _Server:
    def __init__(self, whole: bool = False, gap_s: float = 0.01) -> None:
        self.connections = 0
        self.whole = whole  # the whole stream in one write (an engine that had it all at once)
        self.gap_s = gap_s  # between two events written apart

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                framed = [b"%x\r\n%s\r\n" % (len(event), event) for event in _EVENTS]
                if self.whole:
                    writer.write(b"".join(framed))
                for piece in [] if self.whole else framed:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(self.gap_s)  # each event its own write, like a token
                writer.write(b"0\r\n\r\n")  # the chunked end, after [DONE]
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[_Server, int]]:
    state = _Server()
    listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield state, port


async def _read_until_done(transport: SocketTransport) -> None:
    response = await transport.send("POST", "/v1/chat/completions", b"{}")
    async for events in SseBatches(response):
        if any(e.strip() == "[DONE]" for e in events):
            break
    await response.finish()
    await response.aclose()


async def test_a_stream_read_to_its_done_leaves_the_connection_reusable(
    server: tuple[_Server, int],
) -> None:
    state, port = server
    transport = SocketTransport(f"http://127.0.0.1:{port}", connect_timeout_s=5, read_timeout_s=5)
    for _ in range(3):
        await _read_until_done(transport)
    assert state.connections == 1
    await transport.aclose()


async def test_a_stream_left_early_closes_its_connection(server: tuple[_Server, int]) -> None:
    state, port = server
    transport = SocketTransport(f"http://127.0.0.1:{port}", connect_timeout_s=5, read_timeout_s=5)
    response = await transport.send("POST", "/v1/chat/completions", b"{}")
    async for _events in SseBatches(response):
        break  # the harness went away after the first event
    await response.aclose()  # no finish(): the engine must see the connection close
    await _read_until_done(transport)
    assert state.connections == 2
    await transport.aclose()


async def test_what_one_read_brought_is_handed_on_as_one_piece() -> None:
    """Chunks of the transfer encoding that came in one read are one piece for the relay (one
    write to the harness), not one each; chunks that came apart stay apart (each token on its
    way at once)."""
    pieces = {}
    for whole in (True, False):
        state = _Server(whole=whole)
        listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        async with listener:
            transport = SocketTransport(
                f"http://127.0.0.1:{port}", connect_timeout_s=5, read_timeout_s=5
            )
            response = await transport.send("POST", "/v1/chat/completions", b"{}")
            pieces[whole] = [piece async for piece in response.aiter_bytes()]
            await transport.aclose()
    assert pieces[True] == [b"".join(_EVENTS)]
    assert pieces[False] == _EVENTS


@contextlib.asynccontextmanager
async def _served(state: _Server) -> AsyncIterator[int]:
    """``state``'s server on a free loopback port (the port), until the block ends."""
    listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    async with listener:
        yield listener.sockets[0].getsockname()[1]


async def test_the_read_timeout_bounds_each_read_not_the_whole_stream() -> None:
    """Events 0.3 s apart under a 0.5 s read timeout: the stream (0.9 s in all) is read whole;
    under a 0.1 s one, the first wait longer than that fails with TimeoutError after ~0.1 s
    (not when the next event comes), and the connection is closed, not pooled."""
    state = _Server(gap_s=0.3)
    async with _served(state) as port:
        url = f"http://127.0.0.1:{port}"
        patient = SocketTransport(url, connect_timeout_s=5, read_timeout_s=0.5)
        response = await patient.send("POST", "/v1/chat/completions", b"{}")
        assert b"".join([piece async for piece in response.aiter_bytes()]) == b"".join(_EVENTS)
        await patient.aclose()

        hasty = SocketTransport(url, connect_timeout_s=5, read_timeout_s=0.1)
        response = await hasty.send("POST", "/v1/chat/completions", b"{}")
        pieces = []
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            async for piece in response.aiter_bytes():
                pieces.append(piece)
                began = time.monotonic()
        waited = time.monotonic() - began
        assert pieces == _EVENTS[:1]  # the first event came right after the head, in time
        assert 0.09 <= waited < 0.25, waited
        assert hasty._idle == []
        assert state.connections == 2
        await hasty.aclose()


async def test_a_connection_whose_reader_failed_is_not_reused(
    server: tuple[_Server, int],
) -> None:
    """A read that times out just as its data arrives leaves the data read and the reader
    failed: the next request must go on a fresh connection, not fail on that one."""
    state, port = server
    transport = SocketTransport(f"http://127.0.0.1:{port}", connect_timeout_s=5, read_timeout_s=5)
    await _read_until_done(transport)
    [pooled] = transport._idle
    pooled.reader.set_exception(TimeoutError("timed out as the data came"))
    await _read_until_done(transport)
    assert state.connections == 2
    await transport.aclose()
