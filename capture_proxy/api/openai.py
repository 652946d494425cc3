"""OpenAI-compatible routes, per episode by path or by the ``X-Episode-Id`` header.

The generation routes are answered by the fast lane in front of FastAPI
(:mod:`capture_proxy.api.capture_router`); they are declared here for the OpenAPI schema, and both
call :func:`handle_capture`.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from capture_proxy.api.deps import ServiceDep, StoreDep
from capture_proxy.capture import Endpoint
from capture_proxy.errors import BadRequest
from capture_proxy.proxy import CaptureService

router = APIRouter(tags=["openai"])


async def handle_capture(
    service: CaptureService,
    episode_id: str | None,
    endpoint: Endpoint,
    raw: bytes,
    headers: Mapping[str, str],
) -> Response:
    """One generation request: its episode (path, else ``X-Episode-Id``), JSON body, call."""
    if episode_id is None:
        episode_id = headers.get("x-episode-id")
        if not episode_id:
            raise BadRequest(
                "no episode: use /episodes/{episode_id}/v1/... or send the X-Episode-Id header",
                param="X-Episode-Id",
            )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    return await service.handle(episode_id, endpoint, body, headers)


async def _proxy(
    service: ServiceDep, request: Request, episode_id: str | None, endpoint: Endpoint
) -> Response:
    return await handle_capture(
        service, episode_id, endpoint, await request.body(), request.headers
    )


@router.post("/episodes/{episode_id}/v1/chat/completions")
async def chat(episode_id: str, service: ServiceDep, request: Request) -> Response:
    """OpenAI chat completions (streaming or not), forwarded to vLLM and recorded in the episode.

    The body is the OpenAI request; the answer is the engine's, without the token ids and
    logprobs the proxy added for itself. Headers `X-Agent-Id`, `X-Parent-Agent-Id` and
    `X-Call-Role` attribute the call (DESIGN §4); `X-Capture-Call-Id(s)` come back."""
    return await _proxy(service, request, episode_id, "chat")


@router.post("/episodes/{episode_id}/v1/completions")
async def completions(episode_id: str, service: ServiceDep, request: Request) -> Response:
    """OpenAI (legacy) completions, forwarded and recorded like chat completions."""
    return await _proxy(service, request, episode_id, "completions")


@router.get("/episodes/{episode_id}/v1/models")
async def models(episode_id: str, service: ServiceDep, store: StoreDep) -> Response:
    """The engine's model list (404 for an unknown episode)."""
    await store.get_episode(episode_id)
    return await service.models()


@router.post("/v1/chat/completions")
async def chat_by_header(service: ServiceDep, request: Request) -> Response:
    """Chat completions for harnesses that cannot change the path: the episode is `X-Episode-Id`."""
    return await _proxy(service, request, None, "chat")


@router.post("/v1/completions")
async def completions_by_header(service: ServiceDep, request: Request) -> Response:
    """Completions, the episode named by the `X-Episode-Id` header."""
    return await _proxy(service, request, None, "completions")


@router.get("/v1/models")
async def models_by_header(service: ServiceDep) -> Response:
    """The engine's model list."""
    return await service.models()
