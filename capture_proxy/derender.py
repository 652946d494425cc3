"""The token-in path's answers, turned back into chat completions by vLLM's derender.

A stitched call (capture_proxy/continuation.py) is generated on ``/inference/v1/generate``: ids in,
ids and log-probabilities out. ``/v1/chat/completions/derender`` (vLLM's own detokenizer and
tool/reasoning parsers) makes the chat message of them; the answer is given the chat capture
fields (``prompt_token_ids``, ``token_ids``, ``logprobs.content``) so capture and scrubbing are
those of the pass-through path.

Streams are derendered in batches (:class:`StreamPacing`). With a parser configured, vLLM's
streamed derender cannot carry the parser's state between calls: each call replays every earlier
token of the answer (O(n) per call, documented in vLLM's ``DerenderStreamState``), so derendering
each token as it comes costs O(n²) per answer — 980 ms of the engine's CPU for 256 tokens,
against 6 ms for one whole derender. Batches that grow with the answer keep it O(n).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.upstream import RawResponse, SseBatches, Upstream
from capture_proxy.upstream.transport import FINISH_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """A stitched call, ready for the token-in path."""

    prompt_ids: list[int]
    generate_body: dict[str, Any]
    chat_request: dict[str, Any]  # the prepared chat body, for derender's parsers
    end_of_turn_id: int
    end_of_turn: str
    #: The harness asked for log-probabilities: derender spells their tokens for its answer.
    #: Otherwise derender is sent none (their tokens would be decoded only to be dropped: about
    #: 45 % of a derender's CPU at 32 tokens) and the capture takes them from the engine's answer.
    spelled_logprobs: bool = False


def for_derender(
    generated: dict[str, Any], end_of_turn_id: int, *, logprobs: bool
) -> dict[str, Any]:
    """The generate answer (or chunk) as derender is sent it: without each choice's final
    end-of-turn token and, unless ``logprobs``, without the log-probabilities.

    The end-of-turn token ends the assistant message; it is not part of its text. Derender keeps
    special tokens when a tool parser is configured, so it is removed before derendering (the
    captured ``token_ids`` keep it: the model sampled it). Derender decodes the token of every
    log-probability it is sent; where nobody reads that text, it is sent none (the capture reads
    the engine's own answer: :func:`chat_answer`).
    """
    choices = []
    for choice in generated.get("choices") or []:
        ids = list(choice.get("token_ids") or [])
        trimmed = dict(choice)
        ends = bool(ids) and ids[-1] == end_of_turn_id
        if ends:
            trimmed["token_ids"] = ids[:-1]
        entries = choice.get("logprobs")
        if not logprobs:
            trimmed.pop("logprobs", None)
        elif ends and isinstance(entries, dict) and entries.get("content"):
            trimmed["logprobs"] = dict(entries, content=list(entries["content"])[:-1])
        choices.append(trimmed)
    return dict(generated, choices=choices)


def with_end_of_turn_logprob(
    answer: dict[str, Any], generated: dict[str, Any], token: TokenRequest
) -> dict[str, Any]:
    """Give back the end-of-turn token's logprob entry that derender did not see (as vLLM's chat
    answer lists one entry per sampled token, the end-of-turn included)."""
    sampled = {c.get("index", 0): c for c in generated.get("choices") or []}
    for choice in answer.get("choices") or []:
        source = sampled.get(choice.get("index", 0), {})
        ids = source.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content")
        source_content = (source.get("logprobs") or {}).get("content") or []
        if not ids or ids[-1] != token.end_of_turn_id or content is None or not source_content:
            continue
        if len(content) == len(ids):
            continue
        last = source_content[-1]
        content.append(
            {
                "token": token.end_of_turn,
                "logprob": last["logprob"],
                "bytes": list(token.end_of_turn.encode()),
                "top_logprobs": [],
            }
        )
    return answer


def chat_answer(
    derendered: dict[str, Any], generated: dict[str, Any], token: TokenRequest
) -> dict[str, Any]:
    """A derendered chat completion with vLLM's chat capture fields, as the pass-through gives
    (the log-probabilities from the engine's answer where derender was sent none)."""
    answer = dict(derendered)
    answer["prompt_token_ids"] = token.prompt_ids
    if generated.get("usage"):
        answer["usage"] = generated["usage"]
    sampled = {c.get("index", 0): c for c in generated.get("choices") or []}
    for choice in answer.get("choices") or []:
        source = sampled.get(choice.get("index", 0), {})
        choice["token_ids"] = source.get("token_ids") or []
        if not token.spelled_logprobs:
            choice["logprobs"] = chat_logprobs(source.get("logprobs"))
        called = bool((choice.get("message") or {}).get("tool_calls"))
        if called and choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"  # as vLLM's chat endpoint reports it
    return answer


def chat_logprobs(generated: dict[str, Any] | None) -> dict[str, Any] | None:
    """Generate-format logprobs (``{token_id, logprob, rank}``) in the chat shape a harness expects.

    The token-in path has no token strings; they are given as ``"token_id:<id>"``, vLLM's own
    spelling for ``--return-tokens-as-token-ids``.
    """
    if not isinstance(generated, dict) or generated.get("content") is None:
        return None
    return {
        "content": [
            {
                "token": f"token_id:{item['token_id']}",
                "logprob": item["logprob"],
                "bytes": None,
                "top_logprobs": [
                    {
                        "token": f"token_id:{top['token_id']}",
                        "logprob": top["logprob"],
                        "bytes": None,
                    }
                    for top in item.get("top_logprobs") or []
                ],
            }
            for item in generated["content"]
        ]
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True, slots=True)
class StreamPacing:
    """When a stitched stream's held tokens go to derender.

    ``growth``: a choice's held tokens are derendered once they number at least this fraction of
    those already derendered (and at least one: the first token is never held), so an answer of
    n tokens takes about log(n)/log(1 + growth) derenders, the replayed tokens sum to about
    n·(1 + growth)/growth, and the harness gets its deltas in batches that grow with the answer
    (0: every chunk as it comes, O(n²)). ``max_wait_s``: tokens held this long go at the next
    chunk whatever their number. The choice's last chunk always goes at once.
    """

    growth: float
    max_wait_s: float

    def due(self, held: int, derendered: int, waited_s: float, finished: bool) -> bool:
        return (
            finished
            or held >= max(1.0, self.growth * derendered)
            or (held > 0 and waited_s >= self.max_wait_s)
        )


def merge_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate chunks of one choice as one: ids and log-probability entries in order, the last
    chunk's finish, and each field as the latest chunk that has it gives it (the first chunk's
    ``prompt_token_ids``, the last one's usage)."""
    if len(chunks) == 1:
        return chunks[0]
    merged = dict(chunks[0])
    choice = dict(chunks[0]["choices"][0])
    ids: list[int] = []
    entries: list[Any] = []
    for chunk in chunks:
        merged.update((k, v) for k, v in chunk.items() if v is not None)
        [part] = chunk["choices"]
        choice.update((k, v) for k, v in part.items() if v is not None)
        ids.extend(part.get("token_ids") or ())
        entries.extend((part.get("logprobs") or {}).get("content") or ())
    choice["token_ids"] = ids
    choice["logprobs"] = {"content": entries} if entries else None
    choice["finish_reason"] = chunks[-1]["choices"][0].get("finish_reason")
    merged["choices"] = [choice]
    return merged


#: What a derendered chunk holds of its own (the rest — id, object, created, model — is the
#: stream's).
_PER_CHUNK = frozenset({"choices", "usage", "metrics", "prompt_token_ids"})


class _DerenderFailed(Exception):
    def __init__(self, error: Any) -> None:
        super().__init__(error)
        self.error = error


@dataclass(slots=True)
class _Choice:
    """One choice of a derendered stream: derender's carried state, what it has derendered,
    and the chunk merged from what is held back since."""

    state: Any = None
    derendered: int = 0
    held: list[dict[str, Any]] = field(default_factory=list)
    held_tokens: int = 0
    held_since: float = 0.0
    finished: bool = False


@dataclass(slots=True)
class DerenderedStream:
    """The engine's token stream, derendered in batches into chat completion chunks (a
    :class:`~capture_proxy.upstream.RawResponse`, like the pass-through stream)."""

    upstream: Upstream
    response: RawResponse
    token: TokenRequest
    pacing: StreamPacing
    status_code: int = 200
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _first: bool = True
    _pieces: AsyncGenerator[bytes, None] | None = None
    _last: dict[str, Any] | None = None  # the last chunk derender made

    async def read_some(self) -> bytes:
        if self._pieces is None:
            self._pieces = self.aiter_bytes()
        return await anext(self._pieces, b"")

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_bytes(self) -> AsyncGenerator[bytes, None]:
        """Each read of the engine's stream is taken whole (what came together is held
        together), then every choice that is due (:class:`StreamPacing`) is derendered. A
        derender that fails ends the stream with its error."""
        try:
            async for out in self._derendered():
                yield out
        except _DerenderFailed as failed:
            yield _sse({"error": failed.error})

    async def _derendered(self) -> AsyncGenerator[bytes, None]:
        async for events in SseBatches(self.response):
            for data in events:
                if data.strip() == "[DONE]":
                    for out in await self._flush(everything=True):
                        yield out
                    yield b"data: [DONE]\n\n"
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and len(chunk.get("choices") or ()) == 1:
                    self._hold(chunk)
                    continue
                # an error, or the usage that ends the stream: what is held goes first
                for out in await self._flush(everything=True):
                    yield out
                if not isinstance(chunk, dict) or "choices" not in chunk:
                    yield _sse(chunk if isinstance(chunk, dict) else {"error": {"message": data}})
                    continue
                yield await self._without_choices(chunk)
            for out in await self._flush(everything=False):
                yield out
        for out in await self._flush(everything=True):  # (a stream cut before its [DONE])
            yield out

    def _hold(self, chunk: dict[str, Any]) -> None:
        [choice] = chunk["choices"]
        slot = self._choices.setdefault(int(choice.get("index", 0)), _Choice())
        if not slot.held:
            slot.held_since = time.monotonic()
        slot.held.append(chunk)
        slot.held_tokens += len(choice.get("token_ids") or ())
        slot.finished = choice.get("finish_reason") is not None

    async def _flush(self, *, everything: bool) -> list[bytes]:
        out = []
        now = time.monotonic()
        for slot in self._choices.values():
            if not slot.held:
                continue
            waited = now - slot.held_since
            if everything or self.pacing.due(
                slot.held_tokens, slot.derendered, waited, slot.finished
            ):
                chunk, slot.held = merge_chunks(slot.held), []
                slot.derendered += slot.held_tokens
                slot.held_tokens = 0
                out.append(await self._derender(chunk, slot))
        return out

    async def _derender(self, chunk: dict[str, Any], slot: _Choice) -> bytes:
        reply = await self.upstream.derender_chat(
            {
                "stream": True,
                "generate_chunk": for_derender(chunk, self.token.end_of_turn_id, logprobs=False),
                "stream_state": slot.state,
                "chat_request": self.token.chat_request,
                "prompt_token_ids": self.token.prompt_ids,
                "prompt_tokens": len(self.token.prompt_ids),
            }
        )
        if reply.status_code >= 400 or not isinstance(reply.body, dict):
            error = reply.body.get("error") if isinstance(reply.body, dict) else None
            raise _DerenderFailed(error or {"message": f"derender answered {reply.status_code}"})
        slot.state = reply.body["stream_state"]
        out: dict[str, Any] = reply.body["chunk"]
        self._last = out
        if self._first:
            out["prompt_token_ids"] = self.token.prompt_ids
            self._first = False
        sampled = {int(c.get("index", 0)): c for c in chunk["choices"]}
        for choice in out.get("choices") or []:
            source = sampled.get(int(choice.get("index", 0)), {})
            choice["token_ids"] = source.get("token_ids") or []
            choice["logprobs"] = chat_logprobs(source.get("logprobs"))
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        return _sse(out)

    async def _without_choices(self, chunk: dict[str, Any]) -> bytes:
        """A chunk with no choice (the usage that ends a stream): derender would only wrap it, as
        it wrapped the last one (its ``id``, ``created``, ``model``) — one engine request per
        streamed call saved. (Before any chunk was derendered, derender wraps it; a chunk of
        several choices, which vLLM never streams, goes to derender, which refuses it.)"""
        if self._last is None or chunk.get("choices"):
            first = self._choices.get(0, _Choice())  # (vLLM reads it with the first's state)
            return await self._derender(chunk, _Choice(state=first.state))
        out = {k: v for k, v in self._last.items() if k not in _PER_CHUNK}
        out["choices"] = []
        for key in ("usage", "metrics"):
            if chunk.get(key) is not None:
                out[key] = chunk[key]
        return _sse(out)

    async def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        await self.response.finish(timeout_s)

    async def aclose(self) -> None:
        if self._pieces is not None:  # (read_some's iterator, left at a piece: closed now)
            await self._pieces.aclose()
        await self.response.aclose()
