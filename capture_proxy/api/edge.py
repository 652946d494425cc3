"""The API edge for translated APIs (Messages, Responses): one chat call through the capture path.

A route translates its request to a chat request (``capture_proxy.translate``), hands it to
``CaptureService.handle(episode_id, "chat", body, headers)`` — the same seam the chat route
uses, so admission, capture, commit and stitching are the chat path's — and translates what comes
back:

- a whole JSON answer → the API's answer object (errors → the API's error shape);
- the chat SSE stream → the API's events, chunk by chunk as they arrive. The proxy sends
  ``[DONE]`` only after the call is committed; the translators emit their closing events
  (``message_stop``, ``response.completed``) only on ``[DONE]``, so the harness's last event
  still means "durably recorded". Closing the translated stream closes the proxy's, which
  cancels the upstream request and records the call ``cancelled``.

The ``X-Capture-Call-Id`` / ``X-Capture-Call-Ids`` headers are passed on.
"""

from __future__ import annotations

import json
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Mapping,
)
from typing import Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from capture_proxy.api.auth import authorize_episode
from capture_proxy.api.json_body import read_json
from capture_proxy.api.schemas import ID_PATTERN
from capture_proxy.capture import Endpoint
from capture_proxy.errors import BadRequest
from capture_proxy.proxy import CaptureService
from capture_proxy.responses import ClientWatch, EventStreamResponse

Event = tuple[str, dict[str, Any]]
_KEPT_HEADERS = ("x-capture-call-id", "x-capture-call-ids")


class StreamTranslator(Protocol):
    def feed(self, chunk: dict[str, Any]) -> list[Event]: ...
    def finish(self) -> list[Event]: ...
    def error(self, body: Any) -> list[Event]: ...


async def json_body(request: Request) -> Any:
    """The body, parsed as strictly as the OpenAI routes parse theirs (UTF-8, no NaN, …)."""
    return await read_json(request)


async def episode_of(request: Request, episode: str | None) -> str:
    """The call's episode (the path's, else ``X-Episode-Id``), once its key is accepted."""
    episode_id = episode if episode is not None else header_episode(request)
    await authorize_episode(request, episode_id)
    return episode_id


def header_episode(request: Request) -> str:
    episode_id = request.headers.get("x-episode-id")
    if not episode_id:
        raise BadRequest(
            "no episode: use /episodes/{episode_id}/v1/... or send the X-Episode-Id header",
            param="X-Episode-Id",
        )
    if len(episode_id) > 200 or ID_PATTERN.fullmatch(episode_id) is None:
        raise BadRequest("X-Episode-Id is not an episode id", param="X-Episode-Id")
    return episode_id


def lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A plain dict of lower-case names (what ``attribute`` looks names up by), the first of a
    repeated header kept, as Starlette's ``Headers.get`` does. The capture path looks up a
    dozen names per call: in a dict, not by a scan of the raw headers each time."""
    lowered: dict[str, str] = {}
    for name, value in headers.items():
        lowered.setdefault(name.lower(), value)
    return lowered


async def capture_call(
    service: CaptureService, request: Request, episode_id: str, endpoint: Endpoint, body: Any
) -> Response:
    """``service.handle`` of a request whose body is read, its client watched meanwhile: if it
    leaves, the engine's request is cancelled and the call recorded ``cancelled``."""
    watch = ClientWatch(request.scope, request.receive).start()
    try:
        return await service.handle(
            episode_id, endpoint, body, lower_headers(request.headers), watch
        )
    finally:
        watch.stop()


def kept_headers(response: Response) -> dict[str, str]:
    return {name: response.headers[name] for name in _KEPT_HEADERS if name in response.headers}


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _chat_events(body: AsyncIterable[Any]) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of the proxy's chat stream."""
    buffer = ""
    async for piece in body:
        buffer += piece.decode() if isinstance(piece, bytes | bytearray) else str(piece)
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            data = [line[5:].lstrip() for line in event.splitlines() if line.startswith("data:")]
            if data:
                yield "\n".join(data)


async def _translated(
    body: AsyncIterable[Any], translator: StreamTranslator, render: Callable[[Event], bytes]
) -> AsyncIterator[bytes]:
    events = _chat_events(body)
    try:
        async for data in events:
            out: Iterable[Event]
            if data.strip() == "[DONE]":
                out = translator.finish()
            else:
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
                    out = translator.error(chunk)
                else:
                    out = translator.feed(chunk)
            for event in out:
                yield render(event)
    finally:
        # Shielded: on a client disconnect this runs inside a cancelled scope, and the proxy's
        # stream must still be closed so it records the call cancelled (DESIGN §3).
        with anyio.CancelScope(shield=True):
            await events.aclose()
            close = getattr(body, "aclose", None)
            if close is not None:
                await close()


def translate(
    response: Response,
    *,
    whole: Callable[[dict[str, Any]], dict[str, Any]],
    error: Callable[[int, Any], dict[str, Any]],
    stream: Callable[[], StreamTranslator],
    render: Callable[[Event], bytes] = lambda e: sse_event(*e),
) -> Response:
    """The API's response for what ``CaptureService.handle`` answered."""
    headers = kept_headers(response)
    if isinstance(response, StreamingResponse):
        return EventStreamResponse(
            _translated(response.body_iterator, stream(), render),
            headers={**headers, "cache-control": "no-cache"},
        )
    try:
        payload = json.loads(bytes(response.body))
    except ValueError:
        payload = {"error": {"message": bytes(response.body)[:500].decode(errors="replace")}}
    if response.status_code >= 400:
        return JSONResponse(error(response.status_code, payload), response.status_code, headers)
    return JSONResponse(whole(payload), headers=headers)
