"""A stitched stream is derendered in batches that grow with the answer (capture_proxy/derender.py).

The engine is a double here (one layer: which chunks go to derender, and what the harness gets
back); the real vLLM's streamed derender is exercised by tests/integration/capture_proxy/
test_stitching.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.derender import DerenderedStream, StreamPacing, TokenRequest, merge_chunks
from capture_proxy.upstream import UpstreamReply

EOT = 2


def _chunk(ids: list[int], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    entries = [{"token_id": t, "logprob": -t / 100} for t in ids]
    return {
        "request_id": "r",
        "choices": [
            {
                "index": index,
                "token_ids": ids,
                "logprobs": {"content": entries},
                "finish_reason": finish,
            }
        ],
    }


class _Pieces:
    """The engine's SSE body, one read per piece."""

    status_code = 200

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def read_some(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""

    async def finish(self, timeout_s: float = 0) -> None:
        return None

    async def aclose(self) -> None:
        return None


class _Derender:
    """Derender as vLLM's plain path answers it: the text of the ids, the state carried."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail_at = fail_at

    async def derender_chat(self, body: dict[str, Any]) -> UpstreamReply:
        self.sent.append(body)
        if len(self.sent) == self.fail_at:
            return UpstreamReply(400, {"error": {"message": "invalid stream_state"}})
        chunk = body["generate_chunk"]
        choices = [
            {
                "index": c["index"],
                "delta": {"content": "".join(f"<{t}>" for t in c["token_ids"])},
                "finish_reason": c.get("finish_reason"),
            }
            for c in chunk["choices"]
        ]
        seen = (body["stream_state"] or {}).get("seen", 0)
        tokens = sum(len(c["token_ids"]) for c in chunk["choices"])
        out = {"id": "x", "object": "chat.completion.chunk", "choices": choices}
        return UpstreamReply(200, {"chunk": out, "stream_state": {"seen": seen + tokens}})


def _sse(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _run(
    pieces: list[bytes], pacing: StreamPacing, engine: _Derender
) -> list[dict[str, Any] | str]:
    token = TokenRequest([1, 5], {}, {"messages": []}, end_of_turn_id=EOT, end_of_turn="<e>")
    stream = DerenderedStream(engine, _Pieces(pieces), token, pacing)  # type: ignore[arg-type]
    out: list[dict[str, Any] | str] = []
    while piece := await stream.read_some():
        for event in piece.decode().split("\n\n"):
            if event:
                payload = event.removeprefix("data: ")
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    await stream.aclose()
    return out


def test_pacing_grows_with_the_answer_and_never_holds_the_first_or_last_token() -> None:
    pacing = StreamPacing(growth=0.5, max_wait_s=1.0)
    assert pacing.due(held=1, derendered=0, waited_s=0, finished=False)
    assert not pacing.due(held=3, derendered=8, waited_s=0, finished=False)
    assert pacing.due(held=4, derendered=8, waited_s=0, finished=False)
    assert pacing.due(held=1, derendered=100, waited_s=0, finished=True)
    assert pacing.due(held=1, derendered=100, waited_s=1.0, finished=False)
    assert not pacing.due(held=0, derendered=100, waited_s=5.0, finished=False)
    every = StreamPacing(growth=0, max_wait_s=1.0)
    assert every.due(held=1, derendered=1000, waited_s=0, finished=False)


def test_merged_chunks_keep_every_id_and_logprob_in_order_and_the_last_finish() -> None:
    first = _chunk([7, 8]) | {"prompt_token_ids": [1, 5]}
    merged = merge_chunks([first, _chunk([9]), _chunk([EOT], "stop")])
    [choice] = merged["choices"]
    assert choice["token_ids"] == [7, 8, 9, EOT]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [7, 8, 9, EOT]
    assert choice["finish_reason"] == "stop" and merged["prompt_token_ids"] == [1, 5]


async def test_a_long_answer_takes_logarithmically_many_derenders_and_loses_nothing() -> None:
    ids = list(range(10, 42))  # 32 tokens, each in its own read, as the engine sends them
    pieces = [_sse(_chunk([t], "length" if t == ids[-1] else None)) for t in ids]
    engine = _Derender()
    out = await _run([*pieces, b"data: [DONE]\n\n"], StreamPacing(0.5, 60.0), engine)
    sizes = [len(b["generate_chunk"]["choices"][0]["token_ids"]) for b in engine.sent]
    assert sizes == [1, 1, 1, 2, 3, 4, 6, 9, 5]  # derendered after 1, 2, 3, 5, 8, 12, 18, 27, 32
    assert all("logprobs" not in b["generate_chunk"]["choices"][0] for b in engine.sent)
    chunks = [c for c in out if isinstance(c, dict)]
    assert out[-1] == "[DONE]" and len(chunks) == len(sizes)
    assert chunks[0]["prompt_token_ids"] == [1, 5]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    logprobs = [e["logprob"] for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert logprobs == [-t / 100 for t in ids]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == "".join(f"<{t}>" for t in ids)
    assert engine.sent[-1]["stream_state"] == {"seen": 27}


async def test_growth_zero_derenders_every_chunk_and_what_came_together_goes_together() -> None:
    every = _Derender()
    pieces = [_sse(_chunk([t])) for t in range(10, 14)]
    await _run([*pieces, b"data: [DONE]\n\n"], StreamPacing(0, 60.0), every)
    assert len(every.sent) == 4
    together = _Derender()
    await _run([b"".join(pieces), b"data: [DONE]\n\n"], StreamPacing(0, 60.0), together)
    [sent] = together.sent
    assert sent["generate_chunk"]["choices"][0]["token_ids"] == [10, 11, 12, 13]


async def test_held_tokens_go_before_the_usage_chunk_and_an_error_ends_the_stream() -> None:
    usage = {"request_id": "r", "choices": [], "usage": {"completion_tokens": 3}}
    pieces = [_sse(_chunk([t])) for t in (10, 11, 12)]
    engine = _Derender()
    out = await _run([*pieces, _sse(usage), b"data: [DONE]\n\n"], StreamPacing(10.0, 60.0), engine)
    # the usage chunk is wrapped as derender wrapped the last one, without asking it
    assert [len(b["generate_chunk"]["choices"]) for b in engine.sent] == [1, 1]
    assert engine.sent[1]["generate_chunk"]["choices"][0]["token_ids"] == [11, 12]
    chunks = [c for c in out if isinstance(c, dict)]
    assert chunks[-1] == {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"completion_tokens": 3},
    }
    assert out[-1] == "[DONE]"

    failing = _Derender(fail_at=2)
    out = await _run([*pieces, b"data: [DONE]\n\n"], StreamPacing(0, 60.0), failing)
    assert out[-1] == {"error": {"message": "invalid stream_state"}} and len(failing.sent) == 2


@pytest.mark.parametrize("cut", [True, False])
async def test_a_stream_cut_before_its_end_still_gives_what_it_held(cut: bool) -> None:
    pieces = [_sse(_chunk([t])) for t in (10, 11, 12)]
    engine = _Derender()
    out = await _run(pieces if cut else [*pieces, b"data: [DONE]\n\n"], StreamPacing(9, 60), engine)
    ids = [t for c in out if isinstance(c, dict) for t in c["choices"][0]["token_ids"]]
    assert ids == [10, 11, 12] and (out[-1] == "[DONE]") is not cut
