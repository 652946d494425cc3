"""The API edge for translated APIs (Messages, Responses): one chat call through the capture path.

A route translates its request to a chat request (``capture_proxy.translate``), hands it to
``CaptureService.handle(episode_id, "chat", body, headers)`` — the same seam the chat route
uses, so admission, capture, commit and stitching are the chat path's — and translates the
outcome (:mod:`capture_proxy.outcomes`):

- a whole answer → the API's answer object (errors → the API's error shape);
- a stream → the API's events, piece by piece as the chunks arrive (each piece one write). The
  service yields the stream's end only after the call is committed; the translators emit their
  closing events (``message_stop``, ``response.completed``) only there, so the harness's last
  event still means "durably recorded". Closing the translated stream closes the service's,
  which cancels the upstream request and records the call ``cancelled``.

The ``X-Capture-Call-Id`` / ``X-Capture-Call-Ids`` headers are passed on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fastapi import Request
from starlette.responses import Response

from capture_proxy.api.answers import STREAM_HEADERS, PieceBytes
from capture_proxy.api.auth import authorize_episode
from capture_proxy.api.json_body import read_json
from capture_proxy.api.schemas import ID_PATTERN
from capture_proxy.capture import Endpoint
from capture_proxy.errors import BadRequest
from capture_proxy.outcomes import Answer, Outcome, StreamEnd
from capture_proxy.proxy import CaptureService
from capture_proxy.responses import ClientWatch, EventStreamResponse, JSONResponse

Event = tuple[str, dict[str, Any]]


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
) -> Outcome:
    """``service.handle`` of a request whose body is read, its client watched meanwhile: if it
    leaves, the engine's request is cancelled and the call recorded ``cancelled``."""
    watch = ClientWatch(request.scope, request.receive).start()
    try:
        return await service.handle(
            episode_id, endpoint, body, lower_headers(request.headers), watch
        )
    finally:
        watch.stop()


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def translate(
    outcome: Outcome,
    *,
    whole: Callable[[dict[str, Any]], dict[str, Any]],
    error: Callable[[int, Any], dict[str, Any]],
    stream: Callable[[], StreamTranslator],
    render: Callable[[Event], bytes] = lambda e: sse_event(*e),
) -> Response:
    """The API's response for what ``CaptureService.handle`` answered."""
    headers = dict(outcome.headers)
    if not isinstance(outcome, Answer):
        translator = stream()

        def piece_bytes(chunks: list[dict[str, Any]]) -> bytes:
            return b"".join(render(e) for chunk in chunks for e in translator.feed(chunk))

        def end_bytes(end: StreamEnd) -> bytes:
            head = piece_bytes(end.chunks)  # (fed before the closing events are made)
            closing = translator.finish() if end.error is None else translator.error(end.error)
            return head + b"".join(map(render, closing))

        body = PieceBytes(outcome.pieces, piece_bytes, end_bytes)
        return EventStreamResponse(body, headers={**headers, **STREAM_HEADERS})
    if outcome.status_code >= 400:
        return JSONResponse(error(outcome.status_code, outcome.body), outcome.status_code, headers)
    return JSONResponse(whole(outcome.body), headers=headers)
