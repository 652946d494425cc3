"""``SseBatches``: an engine's SSE stream as the relay reads it — one list of ``data:`` payloads
per read, events split anywhere across reads, transport failures as the service's errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import httpx
import pytest

from capture_proxy.errors import UpstreamError, UpstreamTimeout
from capture_proxy.upstream import SseBatches
from capture_proxy.upstream.transport import FINISH_TIMEOUT_S, HttpxTransport


class _Pieces:
    """A response whose body arrives in the given pieces (then, optionally, fails)."""

    status_code = 200

    def __init__(self, pieces: Sequence[bytes], fail: BaseException | None = None) -> None:
        self.pieces = list(pieces)
        self.fail = fail
        self.reads = 0

    async def read_some(self) -> bytes:
        self.reads += 1
        if self.pieces:
            return self.pieces.pop(0)
        if self.fail is not None:
            raise self.fail
        return b""

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while piece := await self.read_some():
            yield piece

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])

    async def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def _all(pieces: Sequence[bytes]) -> list[list[str]]:
    return [events async for events in SseBatches(_Pieces(pieces))]


async def test_one_list_per_read_with_what_that_read_completed() -> None:
    assert await _all([b'data: {"a": 1}\n\ndata: {"b": 2}\n\n', b"data: [DONE]\n\n"]) == [
        ['{"a": 1}', '{"b": 2}'],
        ["[DONE]"],
    ]


async def test_an_event_split_anywhere_across_reads_is_whole_once_ended() -> None:
    raw = b'data: {"a": 1}\r\n\r\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(raw)):
        batches = await _all([raw[:cut], raw[cut:]])
        assert [e for events in batches for e in events] == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
        assert all(batches)  # a read that completes no event gives no (empty) list


async def test_the_last_event_needs_no_blank_line_and_comments_are_skipped() -> None:
    assert await _all([b": keep-alive\n\ndata: x\n\ndata: [DONE]"]) == [["x"], ["[DONE]"]]
    assert await _all([b"data: x\n\ndata: y\n"]) == [["x"], ["y"]]
    assert await _all([b""]) == []


async def test_next_after_the_end_stays_none_without_reading_again() -> None:
    response = _Pieces([b"data: x\n\n"])
    batches = SseBatches(response)
    assert await batches.next() == ["x"]
    assert await batches.next() is None
    reads = response.reads
    assert await batches.next() is None
    assert response.reads == reads


@pytest.mark.parametrize(
    ("failure", "error"),
    [
        (TimeoutError("the engine sent nothing for 5 s"), UpstreamTimeout),
        (ConnectionError("the engine closed the connection mid-response"), UpstreamError),
    ],
)
async def test_a_transport_failure_mid_stream_is_the_services_error(
    failure: BaseException, error: type[UpstreamError]
) -> None:
    batches = SseBatches(_Pieces([b"data: x\n\n"], fail=failure))
    assert await batches.next() == ["x"]
    with pytest.raises(error, match="the stream") as raised:
        await batches.next()
    assert raised.value.__cause__ is failure


# -- the httpx adapter (unit tests' transport) -------------------------------------------------


class _Body(httpx.AsyncByteStream):
    """A streamed body in pieces, which notes whether it was closed."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece

    async def aclose(self) -> None:
        self.closed = True


async def test_the_httpx_adapter_reads_piece_by_piece_and_closes_a_stream_left_early() -> None:
    bodies: list[_Body] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(_Body([b"data: a\n\n", b"", b"data: b\n\n", b"data: [DONE]\n\n"]))
        return httpx.Response(200, stream=bodies[-1])

    transport = HttpxTransport("http://engine", httpx.MockTransport(answer))
    whole = await transport.send("POST", "/v1/chat/completions", b"{}")
    assert [await whole.read_some() for _ in range(4)] == [
        b"data: a\n\n",
        b"data: b\n\n",  # (an empty piece is not the end)
        b"data: [DONE]\n\n",
        b"",
    ]
    assert bodies[0].closed
    left = await transport.send("POST", "/v1/chat/completions", b"{}")
    assert await SseBatches(left).next() == ["a"]
    assert not bodies[1].closed
    await left.aclose()  # the relay leaves after [DONE] or when the harness hangs up
    assert bodies[1].closed
    await transport.aclose()
