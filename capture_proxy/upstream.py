"""The narrow seam to the engine: JSON request in, JSON (or an open SSE stream) out.

Tests of the proxy logic pass an ``httpx.MockTransport``; integration tests use the real vLLM.
httpx exceptions are translated here into UpstreamError / UpstreamTimeout.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from capture_proxy.errors import UpstreamError, UpstreamTimeout
from capture_proxy.settings import UpstreamSettings


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    status_code: int
    body: Any  # parsed JSON, or {"error": {...}} built from a non-JSON body


def error_body_from(status_code: int, raw: bytes) -> dict[str, Any]:
    """The engine's own OpenAI error body when it sent one, else one built from its text."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed
    message = parsed.get("message") if isinstance(parsed, dict) else None
    text = message or raw.decode("utf-8", "replace")[:2000] or f"upstream status {status_code}"
    return {
        "error": {
            "message": f"upstream error: {text}",
            "type": "upstream_error",
            "param": None,
            "code": status_code,
        }
    }


#: vLLM's token-in-token-out routes (answer 403 unless vLLM runs with --enable-scale-out).
RENDER_CHAT = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER_CHAT = "/v1/chat/completions/derender"
TOKENIZE = "/tokenize"


class Upstream:
    def __init__(
        self, settings: UpstreamSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        headers = {"content-type": "application/json"}
        if settings.api_key is not None:
            headers["authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
        self._client = httpx.AsyncClient(
            base_url=settings.url.rstrip("/"),
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, path: str) -> UpstreamReply:
        try:
            response = await self._client.get(path)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream timed out on GET {path}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream unreachable: {exc!r}") from exc
        return self._reply(response.status_code, response.content)

    async def ping(self, path: str, timeout_s: float) -> None:
        """Readiness: ``GET path`` answers below 400 within ``timeout_s``, else UpstreamError."""
        try:
            response = await self._client.get(path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"engine unreachable: GET {path}: {exc!r}") from exc
        if response.status_code >= 400:
            raise UpstreamError(f"engine answered {response.status_code} on GET {path}")

    async def post_json(self, path: str, body: dict[str, Any]) -> UpstreamReply:
        try:
            response = await self._client.post(path, json=body)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream timed out on POST {path}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream unreachable: {exc!r}") from exc
        return self._reply(response.status_code, response.content)

    async def open_stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Send the request and return the open response (status known, body not read).

        The caller must ``aclose()`` it; closing early aborts the engine's request.
        """
        request = self._client.build_request("POST", path, json=body)
        try:
            return await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream timed out on POST {path}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream unreachable: {exc!r}") from exc

    # -- the token-in path (exact-token continuation) -----------------------------------------

    async def render_chat(self, body: dict[str, Any]) -> UpstreamReply:
        """A chat request → vLLM's GenerateRequest (``token_ids``, ``sampling_params``, …)."""
        return await self.post_json(RENDER_CHAT, body)

    async def generate(self, body: dict[str, Any]) -> UpstreamReply:
        return await self.post_json(GENERATE, body)

    async def open_generate_stream(self, body: dict[str, Any]) -> httpx.Response:
        return await self.open_stream(GENERATE, body)

    async def derender_chat(self, body: dict[str, Any]) -> UpstreamReply:
        """A generate answer (or one streamed chunk) → a chat completion (or chunk)."""
        return await self.post_json(DERENDER_CHAT, body)

    @staticmethod
    def _reply(status_code: int, raw: bytes) -> UpstreamReply:
        if status_code >= 400:
            return UpstreamReply(status_code, error_body_from(status_code, raw))
        try:
            return UpstreamReply(status_code, json.loads(raw))
        except ValueError as exc:
            raise UpstreamError("upstream sent a body that is not JSON") from exc


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE stream, one per event (``[DONE]`` included)."""
    data_lines: list[str] = []
    try:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data_lines.append(line[5:].lstrip(" "))
            elif not line and data_lines:
                yield "\n".join(data_lines)
                data_lines = []
        if data_lines:
            yield "\n".join(data_lines)
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout("upstream stream timed out") from exc
    except (httpx.HTTPError, httpx.StreamError) as exc:
        raise UpstreamError(f"upstream stream broke: {exc!r}") from exc
