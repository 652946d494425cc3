"""The capture path's HTTP answers: JSON by orjson, server-sent events without a task group, and
the watch on a client that leaves while its call waits.

Starlette's ``StreamingResponse`` (under uvicorn's ASGI 2.3) runs every stream in an anyio task
group with a second task listening for the client's disconnect: ~50 µs of CPU per streamed call
(issue 11). :class:`EventStreamResponse` keeps its behaviour — a disconnect stops the stream at
once, wherever it waits, and the body iterator's cleanup runs — with a :class:`ClientWatch` whose
callback cancels the request's own task.

A whole (non-streamed) answer has nobody listening while the engine works: neither uvicorn nor
Starlette cancels a handler whose client left. The capture routes start a :class:`ClientWatch`
once the request's body is read, and the capture service cancels the engine's request when it
fires (DESIGN §3: client disconnect → upstream request cancelled, call ``cancelled``). Under
``serve`` the watch is told by the HTTP protocol itself (:mod:`capture_proxy.http_protocol`), at
no cost per request; under another server it listens on ``receive()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from capture_proxy.http_protocol import LOST_CONNECTION, LostConnection


class JSONResponse(Response):
    """A JSON answer serialised with orjson (starlette's uses the stdlib encoder)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ClientWatch:
    """Whether the client of one ASGI request has left, seen while nothing reads its body.

    ``start()`` subscribes to the request's :class:`~capture_proxy.http_protocol.LostConnection`
    if the scope has one (``serve``), else listens on ``receive()`` (one future; a message other
    than ``http.disconnect`` — an empty body part — just listens again); when the client leaves,
    ``left`` turns true and the callbacks given to :meth:`on_leave` run, once, on the loop.
    ``stop()`` before the response's last write: a server answers ``receive()`` with a
    disconnect once the response is complete too, which is not the client leaving.
    """

    __slots__ = ("_callbacks", "_listening", "_lost", "_receive", "left")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._receive = receive
        extensions = scope.get("extensions") or {}
        lost = extensions.get(LOST_CONNECTION)
        self._lost: LostConnection | None = lost if isinstance(lost, LostConnection) else None
        self._listening: asyncio.Future[Message] | None = None
        self._callbacks: list[Callable[[], object]] = []
        self.left = False

    def start(self) -> ClientWatch:
        if self._lost is not None:
            if self._lost.lost:
                self._leave()
            elif self._leave not in self._lost.callbacks:
                self._lost.callbacks.append(self._leave)
            return self
        if self._listening is None and not self.left:
            listening = asyncio.ensure_future(self._receive())
            listening.add_done_callback(self._on_message)
            self._listening = listening
        return self

    def _on_message(self, future: asyncio.Future[Message]) -> None:
        if future is not self._listening:
            return
        self._listening = None
        if future.cancelled() or future.exception() is not None:
            return
        if future.result()["type"] != "http.disconnect":
            self.start()  # any other message: keep listening, as Starlette does
            return
        self._leave()

    def _leave(self) -> None:
        if self.left:
            return
        self.left = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_leave(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` when the client leaves (at once if it has), unless stopped first."""
        if self.left:
            callback()
        else:
            self._callbacks.append(callback)

    def stop(self) -> None:
        """Stop listening (the callbacks will not run)."""
        self._callbacks = []
        if self._lost is not None and self._leave in self._lost.callbacks:
            self._lost.callbacks.remove(self._leave)
        listening, self._listening = self._listening, None
        if listening is not None:
            listening.cancel()


class LastChunk(bytes):
    """A stream's last bytes: they end the response, in the same write (no empty final one)."""


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` from an async iterator of bytes, each item one write; after a
    :class:`LastChunk` the response is complete and the iterator is closed (its cleanup runs
    after the client has the whole answer)."""

    def __init__(self, content: AsyncIterator[bytes], headers: Mapping[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = ClientWatch(scope, receive)
        watch.on_leave(task.cancel)
        watch.start()
        body: AsyncIterator[bytes] = self.body_iterator  # type: ignore[assignment]
        try:
            start = {"status": self.status_code, "headers": self.raw_headers}
            await send({"type": "http.response.start", **start})
            last = b""
            async for chunk in body:
                if isinstance(chunk, LastChunk):
                    last = bytes(chunk)
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.stop()  # (the server's disconnect after the last write is not a hang-up)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not watch.left or task.uncancel() > 0:  # cancelled by someone else too: go on
                raise
            # The client left: the stream ends here, as Starlette's does.
        finally:
            watch.stop()
            close = getattr(body, "aclose", None)
            if close is not None:
                await asyncio.shield(close())
