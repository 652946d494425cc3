"""OpenAI's HTTP answers for the capture service's outcomes (chat and completions routes).

A whole answer is its JSON (orjson); a stream is ``text/event-stream``, one write per piece the
engine sent, and the last write — the chunks that came with the engine's ``[DONE]``, then
``data: [DONE]`` or the error event that replaces it — only once the service has yielded the
stream's end, so after the call's commit.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
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


class PieceBytes:
    """A captured stream's pieces as the bytes of an answer: one write a piece (a piece that
    makes no bytes is skipped), the last write from the stream's end. Closing it closes the
    service's stream (which records the call cancelled if it had not ended), started or not."""

    __slots__ = ("_end", "_piece", "_pieces")

    def __init__(
        self,
        pieces: AsyncGenerator[Piece, None],
        piece: Callable[[list[dict[str, Any]]], bytes],
        end: Callable[[StreamEnd], bytes],
    ) -> None:
        self._pieces = pieces
        self._piece = piece
        self._end = end

    def __aiter__(self) -> PieceBytes:
        return self

    async def __anext__(self) -> bytes:
        while True:
            piece = await self._pieces.__anext__()
            if isinstance(piece, StreamEnd):
                return LastChunk(self._end(piece))
            out = self._piece(piece)
            if out:
                return out

    async def aclose(self) -> None:
        await self._pieces.aclose()


def _sse_piece(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(map(sse, chunks))


def _sse_end(end: StreamEnd) -> bytes:
    return _sse_piece(end.chunks) + (_DONE if end.error is None else sse(end.error))


def openai_response(outcome: Outcome) -> Response:
    """The HTTP answer of an OpenAI route for what the capture service answered."""
    if isinstance(outcome, Answer):
        return JSONResponse(outcome.body, status_code=outcome.status_code, headers=outcome.headers)
    return EventStreamResponse(
        PieceBytes(outcome.pieces, _sse_piece, _sse_end),
        headers={**outcome.headers, **STREAM_HEADERS},
    )
