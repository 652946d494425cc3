"""OpenAI's HTTP answers for the capture service's outcomes (chat and completions routes).

A whole answer is its JSON (orjson); a stream is ``text/event-stream``, one write per piece the
engine sent, and the last write — the chunks that came with the engine's ``[DONE]``, then
``data: [DONE]`` or the error event that replaces it — only once the service has yielded the
stream's end, so after the call's commit.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.responses import Response

from capture_proxy.outcomes import Answer, Outcome, Piece, StreamEnd
from capture_proxy.responses import EventStreamResponse, JSONResponse, LastChunk

#: What every streamed answer carries besides the call's own headers.
STREAM_HEADERS = {"cache-control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event of a JSON payload."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _EventBytes:
    """The bytes of a captured stream, a piece at a time; closing them closes the service's
    stream (which records the call cancelled if it had not ended), started or not."""

    __slots__ = ("_pieces",)

    def __init__(self, pieces: AsyncGenerator[Piece, None]) -> None:
        self._pieces = pieces

    def __aiter__(self) -> _EventBytes:
        return self

    async def __anext__(self) -> bytes:
        piece = await self._pieces.__anext__()
        if isinstance(piece, StreamEnd):
            end = _DONE if piece.error is None else sse(piece.error)
            return LastChunk(b"".join([*map(sse, piece.chunks), end]))
        return b"".join(map(sse, piece))

    async def aclose(self) -> None:
        await self._pieces.aclose()


def openai_response(outcome: Outcome) -> Response:
    """The HTTP answer of an OpenAI route for what the capture service answered."""
    if isinstance(outcome, Answer):
        return JSONResponse(outcome.body, status_code=outcome.status_code, headers=outcome.headers)
    return EventStreamResponse(
        _EventBytes(outcome.pieces), headers={**outcome.headers, **STREAM_HEADERS}
    )
