"""The capture path's HTTP answers: JSON by orjson, and server-sent events without a task group.

Starlette's ``StreamingResponse`` (under uvicorn's ASGI 2.3) runs every stream in an anyio task
group with a second task listening for the client's disconnect: ~50 µs of CPU per streamed call
(issue 11). :class:`EventStreamResponse` keeps its behaviour — a disconnect stops the stream at
once, wherever it waits, and the body iterator's cleanup runs — with one plain future on
``receive()`` whose callback cancels the request's own task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send


class JSONResponse(Response):
    """A JSON answer serialised with orjson (starlette's uses the stdlib encoder)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


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
        hung_up = False
        listening: asyncio.Future[Message] | None = None

        def listen() -> None:
            nonlocal listening
            listening = asyncio.ensure_future(receive())
            listening.add_done_callback(on_message)

        def on_message(future: asyncio.Future[Message]) -> None:
            nonlocal hung_up
            if future is not listening or future.cancelled() or future.exception() is not None:
                return
            if future.result()["type"] != "http.disconnect":
                listen()  # any other message: keep listening, as Starlette does
                return
            hung_up = True
            task.cancel()

        def stop_listening() -> None:
            nonlocal listening
            if listening is not None:
                future, listening = listening, None
                future.cancel()

        listen()
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
            # The server answers receive() with a disconnect once the response is complete too:
            # stop listening before the last write.
            stop_listening()
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not hung_up or task.uncancel() > 0:  # cancelled by someone else too: go on
                raise
            # The client left: the stream ends here, as Starlette's does.
        finally:
            stop_listening()
            close = getattr(body, "aclose", None)
            if close is not None:
                await asyncio.shield(close())
