"""The engine's vocabulary size, asked once per process, for token-id prompts.

vLLM 0.32 reports no vocabulary size on any route (``/v1/models`` has ``max_model_len``;
``/tokenizer_info`` exists only with ``--enable-tokenizer-info-endpoint`` and holds the
tokenizer's init arguments; ``/detokenize`` answers ``""`` for an unknown id). What it does do is
refuse, before generating, a completions prompt holding an id above
``max(tokenizer.max_token_id, model vocab - 1)`` with 400 "Token id N is out of vocabulary". So
the size is found with that rule itself: a one-token prompt ``[id]`` with ``max_tokens: 1``,
doubling ``id`` from 256 until refused, then bisecting — about 2 log2(V) requests, once per
process, on the first token-id prompt (the tiny model's 4096: 17 requests, 0.74 s on this machine;
benchmarks/bench_input_checks.py).

``limits.vocab_size`` set in the settings skips the probe. If the engine cannot be asked (down,
or it answers something else), nothing is cached and the upper bound is not checked for that
request (the engine then judges the ids itself; negative ids are refused regardless).
"""

from __future__ import annotations

import asyncio
import logging

from capture_proxy.errors import CaptureProxyError
from capture_proxy.upstream import Upstream

log = logging.getLogger(__name__)

_FIRST_GUESS = 256
_CEILING = 1 << 31  # token ids are int32 in the store


class EngineVocabulary:
    """``await size()``: the number of token ids the engine accepts, or None if unknown."""

    def __init__(self, upstream: Upstream, configured: int | None = None) -> None:
        self._upstream = upstream
        self._size = configured
        self._lock = asyncio.Lock()

    async def size(self) -> int | None:
        if self._size is not None:
            return self._size
        async with self._lock:
            if self._size is None:
                try:
                    self._size = await self._probe()
                    log.info("engine vocabulary: %d token ids", self._size)
                except _Unknown as exc:
                    log.warning("engine vocabulary unknown (not checked this time): %s", exc)
        return self._size

    async def _model(self) -> str | None:
        reply = await self._upstream.get_json("/v1/models")
        data = reply.body.get("data") if isinstance(reply.body, dict) else None
        if reply.status_code != 200 or not data or not isinstance(data[0], dict):
            raise _Unknown(f"/v1/models answered {reply.status_code}")
        model = data[0].get("id")
        return model if isinstance(model, str) else None

    async def _accepts(self, model: str | None, token_id: int) -> bool:
        body: dict[str, object] = {"prompt": [token_id], "max_tokens": 1, "temperature": 0}
        if model is not None:
            body["model"] = model
        reply = await self._upstream.post_json("/v1/completions", body)
        if reply.status_code == 200:
            return True
        message = str(reply.body.get("error", {}).get("message", ""))
        if reply.status_code == 400 and "out of vocabulary" in message:
            return False
        raise _Unknown(f"probe of id {token_id} answered {reply.status_code}: {message[:200]}")

    async def _probe(self) -> int:
        try:
            model = await self._model()
            if not await self._accepts(model, 0):
                raise _Unknown("the engine refuses token id 0")
            low, high = 0, _FIRST_GUESS  # low is accepted; high is to be tried
            while high < _CEILING and await self._accepts(model, high):
                low, high = high, high * 2
            while high - low > 1:  # low accepted, high refused (or the ceiling)
                middle = (low + high) // 2
                if await self._accepts(model, middle):
                    low = middle
                else:
                    high = middle
        except CaptureProxyError as exc:
            raise _Unknown(str(exc)) from exc
        return low + 1


class _Unknown(Exception):
    """The engine could not tell (internal: the check is skipped, nothing cached)."""
