"""What the pre-admission checks cost (issue 12.3), and the vocabulary probe on the real vLLM.

    .venv/bin/python benchmarks/bench_input_checks.py [--engine] [--upstream URL]

Part 1 (no engine): per request body, the time of what the OpenAI routes do before admission —
strict JSON (:func:`capture_proxy.api.json_body.parse_json`, also alone) and the typed body check
(:func:`capture_proxy.api.openai_checks.check_types`) — against the plain ``json.loads`` the routes
did before, for chat bodies of growing size (a conversation of N turns) and a token-id prompt.
Best of 5 runs of 200 (20 for the largest) repetitions.

Part 2 (``--engine``): the engine's vocabulary found by
:class:`capture_proxy.engine_vocab.EngineVocabulary` — the probes sent and the wall time, once.
Without ``--upstream`` it builds the tiny model and starts vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from capture_proxy.api.json_body import parse_json
from capture_proxy.api.openai_checks import check_types, prompt_token_ids
from capture_proxy.engine_vocab import EngineVocabulary
from capture_proxy.settings import UpstreamSettings
from capture_proxy.upstream import Upstream


def _chat_body(turns: int) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are careful. " * 20}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Step {i}: list the files. " * 10})
        messages.append({"role": "assistant", "content": f"Done with step {i}. " * 30})
    body = {"model": "tiny", "messages": messages, "temperature": 1.0, "stream": True}
    return json.dumps(body).encode()


def _best(fn: Callable[[], object], reps: int) -> float:
    """Best of 5 runs; microseconds per call."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - start) / reps)
    return min(runs) * 1e6


def part1() -> None:
    cases = [(f"chat, {t} turns", _chat_body(t), "chat") for t in (1, 10, 100, 1000)]
    ids = json.dumps({"model": "tiny", "prompt": list(range(3, 8003))}).encode()
    cases.append(("completions, 8000 ids", ids, "completions"))
    print(
        "| body | size | json.loads (µs) | strict JSON (µs) | strict JSON + types (µs) "
        "| extra (µs) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, raw, endpoint in cases:
        reps = 20 if len(raw) > 1_000_000 else 200

        def checked(raw: bytes = raw, endpoint: str = endpoint) -> None:
            body = parse_json(raw)
            model = check_types(endpoint, body)  # type: ignore[arg-type]
            if endpoint == "completions":
                prompt_token_ids(model.prompt)  # type: ignore[attr-defined]

        plain = _best(lambda raw=raw: json.loads(raw), reps)  # type: ignore[misc]
        parsed = _best(lambda raw=raw: parse_json(raw), reps)  # type: ignore[misc]
        strict = _best(checked, reps)
        size = f"{len(raw) / 1024:,.0f} KiB"
        print(
            f"| {name} | {size} | {plain:,.0f} | {parsed:,.0f} | {strict:,.0f} "
            f"| {strict - plain:,.0f} |"
        )


class _Counting(httpx.AsyncBaseTransport):
    """The real transport, remembering the probed token id of every POST."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.sent.append(json.loads(request.content)["prompt"][0])
        return await self.inner.handle_async_request(request)


async def _probe(url: str) -> None:
    transport = _Counting()
    upstream = Upstream(UpstreamSettings(url=url), transport=transport)
    start = time.perf_counter()
    size = await EngineVocabulary(upstream).size()
    elapsed = time.perf_counter() - start
    await upstream.aclose()
    print(f"vocabulary {size}: {len(transport.sent)} probes in {elapsed:.2f} s {transport.sent}")


def part2(upstream: str | None) -> None:
    if upstream is not None:
        asyncio.run(_probe(upstream))
        return
    from capture_devkit.engine import VLLMServer
    from capture_devkit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        with VLLMServer(model, served_model_name="tiny", log_path=Path(tmp) / "vllm.log") as vllm:
            asyncio.run(_probe(vllm.base_url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="also probe a real vLLM")
    parser.add_argument("--upstream", help="a running vLLM (implies --engine)")
    args = parser.parse_args()
    part1()
    if args.engine or args.upstream:
        part2(args.upstream)


if __name__ == "__main__":
    main()
