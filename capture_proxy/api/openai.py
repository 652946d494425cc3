"""OpenAI-compatible routes, per episode by path or by the ``X-Episode-Id`` header."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from capture_proxy.api.deps import ServiceDep, StoreDep
from capture_proxy.capture import Endpoint
from capture_proxy.errors import BadRequest

router = APIRouter(tags=["openai"])


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


def _header_episode(request: Request) -> str:
    episode_id = request.headers.get("x-episode-id")
    if not episode_id:
        raise BadRequest(
            "no episode: use /episodes/{episode_id}/v1/... or send the X-Episode-Id header",
            param="X-Episode-Id",
        )
    return episode_id


async def _proxy(
    service: ServiceDep, request: Request, episode_id: str, endpoint: Endpoint
) -> Response:
    body = await _json_body(request)
    return await service.handle(episode_id, endpoint, body, request.headers)


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
    return await _proxy(service, request, _header_episode(request), "chat")


@router.post("/v1/completions")
async def completions_by_header(service: ServiceDep, request: Request) -> Response:
    """Completions, the episode named by the `X-Episode-Id` header."""
    return await _proxy(service, request, _header_episode(request), "completions")


@router.get("/v1/models")
async def models_by_header(service: ServiceDep) -> Response:
    """The engine's model list."""
    return await service.models()
