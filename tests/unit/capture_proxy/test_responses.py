"""EventStreamResponse: Starlette's streaming behaviour without its task group (issue 11); the
ClientWatch under it and under the capture routes' whole answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from capture_proxy.http_protocol import LOST_CONNECTION, LostConnection
from capture_proxy.responses import ClientWatch, EventStreamResponse, LastChunk


class _Server:
    """An ASGI server's two ends for one request: ``receive`` answers ``http.disconnect`` when
    the client hangs up or (as uvicorn does) once the response is complete."""

    def __init__(self, first: dict[str, Any] | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.over = asyncio.Event()
        self.first = first  # a message answered before anything else (not a disconnect)

    async def receive(self) -> dict[str, Any]:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        await self.over.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.over.set()


@pytest.mark.parametrize("first", [None, {"type": "http.request", "body": b"", "more_body": False}])
async def test_a_disconnect_stops_the_stream_where_it_waits_and_runs_its_cleanup(
    first: dict[str, Any] | None,
) -> None:
    server = _Server(first)  # another message first: the response goes on listening
    cleaned = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the engine's next chunk never comes
            yield b"data: 2\n\n"
        finally:
            cleaned.set()

    response = EventStreamResponse(events(), headers={})
    serving = asyncio.create_task(response({"type": "http"}, server.receive, server.send))
    while len(server.sent) < 2:
        await asyncio.sleep(0)
    server.over.set()  # the client hangs up
    await asyncio.wait_for(serving, 2)  # ends at once, without raising
    assert cleaned.is_set()
    assert [m.get("body") for m in server.sent] == [None, b"data: 1\n\n"]


async def test_a_complete_stream_is_not_cancelled_by_the_servers_last_disconnect() -> None:
    server = _Server()

    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    response = EventStreamResponse(events(), headers={"x-a": "1"})
    await response({"type": "http"}, server.receive, server.send)
    await asyncio.sleep(0.01)  # the disconnect answered after completion cancels nothing
    assert server.sent[0]["status"] == 200
    assert (b"x-a", b"1") in server.sent[0]["headers"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in server.sent[0]["headers"]
    bodies = [m["body"] for m in server.sent[1:]]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_cancellation_from_elsewhere_still_propagates() -> None:
    server = _Server()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.Event().wait()
        yield b"never"  # pragma: no cover

    response = EventStreamResponse(events(), headers={})
    serving = asyncio.create_task(response({"type": "http"}, server.receive, server.send))
    while len(server.sent) < 2:
        await asyncio.sleep(0)
    serving.cancel()  # e.g. the server shutting down
    try:
        await serving
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the shutdown's cancellation was swallowed")


async def test_a_last_chunk_completes_the_response_in_its_own_write_then_cleans_up() -> None:
    """The capture path's [DONE] (with the chunks that came with the engine's) is the last write;
    the iterator's cleanup (reading the engine's stream end) runs after the client has it all."""
    server = _Server()
    order: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 0\n\n"
            yield LastChunk(b"data: 1\n\ndata: [DONE]\n\n")
            order.append("went on after the last chunk")
        finally:
            order.append(f"cleanup, response complete: {server.over.is_set()}")

    response = EventStreamResponse(events(), headers={})
    await response({"type": "http"}, server.receive, server.send)
    bodies = [(m["body"], m["more_body"]) for m in server.sent[1:]]
    assert bodies == [(b"data: 0\n\n", True), (b"data: 1\n\ndata: [DONE]\n\n", False)]
    assert order == ["cleanup, response complete: True"]


async def test_a_watch_on_receive_tells_a_leave_once_and_nothing_after_stop() -> None:
    server = _Server({"type": "http.request", "body": b"", "more_body": False})
    told: list[str] = []
    watch = ClientWatch({"type": "http"}, server.receive).start()
    watch.on_leave(lambda: told.append("a"))
    for _ in range(3):
        await asyncio.sleep(0)  # an empty body part: it listens again
    assert told == [] and not watch.left
    server.over.set()  # the client hangs up
    for _ in range(3):
        await asyncio.sleep(0)
    assert told == ["a"] and watch.left
    watch.on_leave(lambda: told.append("late"))  # after the leave: at once
    assert told == ["a", "late"]

    quiet = _Server()
    stopped = ClientWatch({"type": "http"}, quiet.receive).start()
    stopped.on_leave(lambda: told.append("stopped"))
    stopped.stop()
    quiet.over.set()  # (the server's disconnect after a complete response)
    for _ in range(3):
        await asyncio.sleep(0)
    assert "stopped" not in told and not stopped.left


async def test_a_watch_with_the_protocols_lost_connection_never_reads_receive() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("the protocol tells the watch; receive() is not read")

    lost = LostConnection()
    scope = {"type": "http", "extensions": {LOST_CONNECTION: lost}}
    told: list[int] = []
    watch = ClientWatch(scope, receive).start()
    watch.on_leave(lambda: told.append(1))
    stopped = ClientWatch(scope, receive).start()
    stopped.on_leave(lambda: told.append(2))
    stopped.stop()
    assert len(lost.callbacks) == 1
    lost.fire()  # the connection is lost before the response completed
    assert told == [1] and watch.left and not stopped.left
    assert ClientWatch(scope, receive).start().left  # started after the loss: left at once
