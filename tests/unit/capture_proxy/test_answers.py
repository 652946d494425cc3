"""The API layer's answers for the capture service's outcomes: OpenAI's SSE bytes and the
translated APIs' events, a write per piece, the last write from the stream's end, and the
service's stream closed whenever the answer is (capture_proxy/outcomes.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from capture_proxy.api.answers import openai_response
from capture_proxy.api.edge import translate
from capture_proxy.outcomes import Answer, Piece, Stream, StreamEnd
from capture_proxy.responses import EventStreamResponse, JSONResponse, LastChunk


class _Pieces:
    """The service's side of a stream: yields the pieces given, records whether it was closed
    and how far it got."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces = pieces
        self.yielded = 0
        self.closed = False

    async def run(self) -> AsyncGenerator[Piece, None]:
        try:
            for piece in self.pieces:
                self.yielded += 1
                yield piece
        finally:
            self.closed = True


def _body(response: object) -> Any:
    assert isinstance(response, EventStreamResponse)
    return response.body_iterator


async def _writes(response: object) -> list[bytes]:
    body = _body(response)
    return [chunk async for chunk in body]


async def test_a_whole_answer_is_its_json_with_the_calls_headers() -> None:
    answer = Answer({"id": "x", "big": 2**40}, 200, {"x-capture-call-id": "call_1"})
    response = openai_response(answer)
    assert isinstance(response, JSONResponse) and response.status_code == 200
    assert json.loads(bytes(response.body)) == {"id": "x", "big": 2**40}
    assert response.headers["x-capture-call-id"] == "call_1"
    error = openai_response(Answer({"error": {"message": "no"}}, 502))
    assert error.status_code == 502


async def test_an_openai_stream_is_one_write_a_piece_and_ends_with_done_after_the_end() -> None:
    source = _Pieces([[{"a": 1}, {"a": 2}], [{"a": 3}], StreamEnd([{"a": 4}])])
    response = openai_response(Stream(source.run(), {"x-capture-call-id": "call_1"}))
    assert response.headers["cache-control"] == "no-cache"
    writes = await _writes(response)
    assert writes == [
        b'data: {"a":1}\n\ndata: {"a":2}\n\n',
        b'data: {"a":3}\n\n',
        b'data: {"a":4}\n\ndata: [DONE]\n\n',
    ]
    assert isinstance(writes[-1], LastChunk) and not isinstance(writes[0], LastChunk)


async def test_an_openai_stream_that_could_not_be_recorded_ends_with_the_error_not_done() -> None:
    error = {"error": {"message": "episode closed", "type": "conflict"}}
    source = _Pieces([[{"a": 1}], StreamEnd([], error)])
    writes = await _writes(openai_response(Stream(source.run())))
    assert writes[-1] == b'data: {"error":{"message":"episode closed","type":"conflict"}}\n\n'
    assert b"[DONE]" not in b"".join(writes)


async def test_closing_an_answer_closes_the_services_stream_started_or_not() -> None:
    started = _Pieces([[{"a": 1}], [{"a": 2}], StreamEnd()])
    body = _body(openai_response(Stream(started.run())))
    assert await body.__anext__() == b'data: {"a":1}\n\n'
    await body.aclose()
    assert started.closed and started.yielded == 1  # (the service records the call cancelled)
    never = _Pieces([StreamEnd()])
    body = _body(openai_response(Stream(never.run())))
    await body.aclose()  # closed before its first piece: nothing runs, nothing is left open
    assert never.yielded == 0


class _Translator:
    """Events for chunks with text only; the closing events at the end."""

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return [("delta", {"text": chunk["text"]})] if chunk.get("text") else []

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        return [("stop", {})]

    def error(self, body: Any) -> list[tuple[str, dict[str, Any]]]:
        return [("error", body)]


def _translate(outcome: Answer | Stream) -> Any:
    return translate(
        outcome,
        whole=lambda answer: {"translated": answer},
        error=lambda status, body: {"status": status, "was": body},
        stream=_Translator,
        render=lambda e: f"{e[0]}:{json.dumps(e[1], separators=(',', ':'))}|".encode(),
    )


async def test_a_translated_stream_skips_pieces_without_events_and_closes_at_the_end() -> None:
    source = _Pieces(
        [[{"text": "a"}, {"text": ""}], [{"role": "assistant"}], [{"text": "b"}], StreamEnd()]
    )
    response = _translate(Stream(source.run(), {"x-capture-call-id": "c"}))
    assert response.headers["x-capture-call-id"] == "c"
    writes = await _writes(response)
    assert writes == [b'delta:{"text":"a"}|', b'delta:{"text":"b"}|', b"stop:{}|"]
    assert isinstance(writes[-1], LastChunk)
    failed = _Pieces([[{"text": "a"}], StreamEnd([{"text": "z"}], {"error": {"message": "x"}})])
    writes = await _writes(_translate(Stream(failed.run())))
    assert writes[-1] == b'delta:{"text":"z"}|error:{"error":{"message":"x"}}|'


async def test_a_translated_whole_answer_or_error_is_translated_without_a_json_round_trip() -> None:
    ok = _translate(Answer({"id": "x"}, 200, {"x-capture-call-id": "c"}))
    assert json.loads(bytes(ok.body)) == {"translated": {"id": "x"}}
    assert ok.headers["x-capture-call-id"] == "c"
    failed = _translate(Answer({"error": {"message": "m"}}, 503))
    assert failed.status_code == 503
    assert json.loads(bytes(failed.body)) == {"status": 503, "was": {"error": {"message": "m"}}}
