"""A pure ASGI middleware that answers 413 to a body over ``limits.max_body_bytes``, unread.

Two checks, both before the route sees a byte:

- a declared ``Content-Length`` over the limit is answered at once; the body is never read (one
  within the limit is all the server reads: that request passes through untouched, its
  ``receive`` and ``send`` not wrapped — a stream's every piece goes through ``send``);
- a body without one (chunked) is counted as it streams in; the chunk that crosses the limit
  stops reading, whatever the route then makes of the broken body is dropped, and the client
  gets the 413 — unless the response had already started, which a route that reads its body
  first never does.

Either way nothing is admitted: routes read their body before they touch the store. The answer
carries ``connection: close`` because the rest of the body is left unread on the wire.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capture_proxy.errors import PayloadTooLarge


class _TooLarge(Exception):
    """Raised into the app from ``receive`` when the streamed body crosses the limit."""


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is larger than {limit} bytes (limits.max_body_bytes)",
        code="body_too_large",
    )


async def _answer_413(send: Send, limit: int) -> None:
    body = json.dumps(too_large(limit).to_body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _declared_length(scope: Scope) -> int | None:
    """The body's declared length; None when none is declared, or a transfer coding is too (the
    servers refuse both, but the body is then counted as it comes, whatever the length says)."""
    length = None
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
        elif name == b"transfer-encoding":
            return None
    return length


class _Guard:
    """One request's byte count, and whether its answer is to be replaced by the 413."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.received = 0
        self.tripped = False
        self.started = False

    async def receive(self) -> Message:
        if self.tripped:
            raise _TooLarge
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.tripped = True
                raise _TooLarge
        return message

    async def send(self, message: Message) -> None:
        if self.tripped and not self.started:
            return  # the route's answer to a body it could not read: replaced by the 413
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None:
            if declared > self.limit:
                await _answer_413(send, self.limit)
            else:  # the server reads no more than the declared length: nothing to count
                await self.app(scope, receive, send)
            return
        guard = _Guard(receive, send, self.limit)
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if not guard.tripped:
                raise
        if guard.tripped and not guard.started:
            await _answer_413(send, self.limit)
