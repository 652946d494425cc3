"""Seeded requests whose prompts together exceed one engine step's token budget.

vLLM 0.32 on CPU killed its engine ("CPU Generator does not use offset") when a request with its
own ``seed`` had its prefill split over two steps; ``capture-proxy train`` seeds every request
and died at iteration 14 of 20. The dev kit's launcher runs whole prefills
(``--no-enable-chunked-prefill``): this must keep every such request served.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from capture_devkit.engine import VLLMServer

pytestmark = pytest.mark.vllm

REQUESTS = 12
PROMPT_TOKENS = 450  # 12 x 450 = 5,400 prompt tokens: more than vLLM's default step of 2,048


async def test_concurrent_seeded_requests_beyond_one_step_are_all_served(
    vllm_server: VLLMServer,
) -> None:
    async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=120) as client:

        async def one(i: int) -> httpx.Response:
            prompt = [(7 * i + k) % 4000 + 10 for k in range(PROMPT_TOKENS)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "seed": 1000 + i}
            return await client.post("/v1/completions", json=body)

        answers = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        assert [a.status_code for a in answers] == [200] * REQUESTS, answers[0].text
        assert (await client.get("/health")).status_code == 200  # the engine is still alive
