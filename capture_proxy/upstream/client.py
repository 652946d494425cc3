"""The narrow seam to the engine: JSON request in, JSON (or an open SSE stream) out.

One client, one error translation: whatever the transport raises (refused or broken connection,
timeout, malformed HTTP) becomes :class:`~capture_proxy.errors.UpstreamError` or
:class:`~capture_proxy.errors.UpstreamTimeout` here, for whole answers and streams alike.
JSON is parsed and written with orjson.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from capture_proxy.errors import UpstreamError, UpstreamTimeout
from capture_proxy.settings import UpstreamSettings
from capture_proxy.upstream.transport import (
    HttpxTransport,
    ProtocolError,
    RawResponse,
    SocketTransport,
    Transport,
)

#: vLLM's chat render (403 unless vLLM runs with --enable-scale-out) and tokenizer routes.
RENDER_CHAT = "/v1/chat/completions/render"
TOKENIZE = "/tokenize"


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    status_code: int
    body: Any  # parsed JSON, or {"error": {...}} built from a non-JSON body


def error_body_from(status_code: int, raw: bytes) -> dict[str, Any]:
    """The engine's own OpenAI error body when it sent one, else one built from its text."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed
    message = parsed.get("message") if isinstance(parsed, dict) else None
    text = message or raw.decode("utf-8", "replace")[:2000] or f"upstream status {status_code}"
    return {
        "error": {
            "message": f"upstream error: {text}",
            "type": "upstream_error",
            "param": None,
            "code": status_code,
        }
    }


def _dumps(body: dict[str, Any]) -> bytes:
    """orjson, or the standard encoder for what orjson refuses (integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


#: What a transport raises when the engine fails (TimeoutError and ConnectionError are OSErrors).
_TRANSPORT_FAILURES = (OSError, ProtocolError)


def _translation(exc: OSError | ProtocolError, what: str) -> UpstreamError:
    """The one place transport failures become the service's errors."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream timed out on {what}")
    return UpstreamError(f"upstream unreachable on {what}: {exc!r}")


@contextmanager
def translated(what: str) -> Iterator[None]:
    try:
        yield
    except _TRANSPORT_FAILURES as exc:
        raise _translation(exc, what) from exc


class Upstream:
    def __init__(
        self, settings: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        timeouts = {
            "connect_timeout_s": settings.connect_timeout_s,
            "read_timeout_s": settings.timeout_s,
        }
        self._transport: Transport
        if transport is None:
            sockets = SocketTransport(settings.url, **timeouts)
            if settings.api_key is not None:
                sockets.extra_headers = (
                    f"authorization: Bearer {settings.api_key.get_secret_value()}\r\n"
                )
            self._transport = sockets
        else:
            adapter = HttpxTransport(settings.url, transport, **timeouts)
            if settings.api_key is not None:
                adapter.extra_headers = {
                    "authorization": f"Bearer {settings.api_key.get_secret_value()}"
                }
            self._transport = adapter

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def _call(self, method: str, path: str, body: bytes | None) -> UpstreamReply:
        with translated(f"{method} {path}"):
            response = await self._transport.send(method, path, body)
            raw = await response.aread()
        if response.status_code >= 400:
            return UpstreamReply(response.status_code, error_body_from(response.status_code, raw))
        try:
            return UpstreamReply(response.status_code, orjson.loads(raw))
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"upstream sent a body that is not JSON on {path}") from exc

    async def get_json(self, path: str) -> UpstreamReply:
        return await self._call("GET", path, None)

    async def ping(self, path: str, timeout_s: float) -> None:
        """Readiness: ``GET path`` answers below 400 within ``timeout_s``, else UpstreamError."""
        try:
            with translated(f"GET {path}"):
                async with asyncio.timeout(timeout_s):
                    response = await self._transport.send("GET", path, None)
                    await response.aread()  # vLLM's /health answers an empty body
        except UpstreamError as exc:
            raise UpstreamError(f"engine unreachable: GET {path}: {exc.message}") from exc
        if response.status_code >= 400:
            raise UpstreamError(f"engine answered {response.status_code} on GET {path}")

    async def post_json(self, path: str, body: dict[str, Any]) -> UpstreamReply:
        return await self._call("POST", path, _dumps(body))

    async def open_stream(self, path: str, body: dict[str, Any]) -> RawResponse:
        """Send the request and return the open response (status known, body not read).

        The caller must ``aclose()`` it; closing early aborts the engine's request.
        """
        with translated(f"POST {path}"):
            return await self._transport.send("POST", path, _dumps(body))

    # -- exact-token continuation ------------------------------------------------------------

    async def render_chat(self, body: dict[str, Any]) -> UpstreamReply:
        """A chat request → vLLM's GenerateRequest (``token_ids``, ``sampling_params``, …)."""
        return await self.post_json(RENDER_CHAT, body)


class SseBatches:
    """The ``data:`` payloads of an SSE stream (``[DONE]`` included), as they arrive: one list
    per read from the engine, so a relay can pass on together what arrived together.

    ``await batches.next()`` gives the next list, None after the last; ``async for`` works too.
    A relay awaits ``next()`` once per piece the engine sends, so this is a plain object reading
    the response directly — no stack of async generators resumed for every token.
    """

    __slots__ = ("_data", "_ended", "_pending", "_response")

    def __init__(self, response: RawResponse) -> None:
        self._response = response
        self._data: list[str] = []  # the data lines of the event being read
        self._pending = b""  # a line not ended yet
        self._ended = False

    def __aiter__(self) -> SseBatches:
        return self

    async def __anext__(self) -> list[str]:
        events = await self.next()
        if events is None:
            raise StopAsyncIteration
        return events

    async def next(self) -> list[str] | None:
        while not self._ended:
            try:
                piece = await self._response.read_some()
            except _TRANSPORT_FAILURES as exc:
                raise _translation(exc, "the stream") from exc
            if not piece:
                self._ended = True
                return self._rest()
            events = self._events(piece)
            if events:
                return events
        return None

    def _events(self, piece: bytes) -> list[str]:
        *lines, self._pending = (self._pending + piece).split(b"\n")
        events = []
        data = self._data
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            elif not line and data:
                events.append("\n".join(data))
                data.clear()
        return events

    def _rest(self) -> list[str] | None:
        """What the stream's end leaves: an event the engine did not end with a blank line."""
        if self._pending.startswith(b"data:"):
            self._data.append(self._pending[5:].decode("utf-8", "replace").lstrip(" "))
        if not self._data:
            return None
        return ["\n".join(self._data)]


async def sse_events(response: RawResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE stream, one per event (``[DONE]`` included)."""
    async for events in SseBatches(response):
        for event in events:
            yield event
