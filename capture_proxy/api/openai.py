"""OpenAI-compatible routes, per episode by path or by the ``X-Episode-Id`` header.

Each request passes, in this order, before anything is admitted: the body size limit (the
:class:`~capture_proxy.api.body_limit.BodyLimit` middleware, 413), the episode's key (401, when
the proxy runs with an admin key), strict JSON (400), the field types, ``n`` and the prompt's
token ids (400, :mod:`capture_proxy.api.openai_checks`). Then the capture service admits and
forwards it.

The generation routes are answered by the fast lane in front of FastAPI's routing
(:mod:`capture_proxy.api.capture_router`, inside the body limit); they are declared here for the
OpenAPI schema, and both call :func:`handle_capture`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from starlette.responses import Response

from capture_proxy.api.answers import openai_response
from capture_proxy.api.auth import authorize_episode
from capture_proxy.api.deps import ServiceDep, StoreDep
from capture_proxy.api.edge import capture_call
from capture_proxy.api.json_body import read_json
from capture_proxy.api.openai_checks import (
    check_n,
    check_token_ids,
    check_types,
    prompt_token_ids,
)
from capture_proxy.api.openai_schemas import UPSTREAM_RESPONSES
from capture_proxy.api.schemas import ID_PATTERN, EpisodeIdPath
from capture_proxy.capture import Endpoint
from capture_proxy.engine_vocab import EngineVocabulary
from capture_proxy.errors import BadRequest
from capture_proxy.proxy import CaptureService

router = APIRouter(tags=["openai"], responses=UPSTREAM_RESPONSES)

EpisodeHeader = Annotated[
    str | None,
    Header(
        alias="X-Episode-Id",
        description="The episode of a `/v1/…` call (harnesses that cannot change the path).",
    ),
]

_COMPLETION_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The engine's answer (JSON), or its SSE stream when `stream` is true; "
        "X-Capture-Call-Id names the recorded call.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {  # the schema of one event (OpenAPI 3.1)
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {
                            "type": "string",
                            "description": "A chunk (JSON), an error object (JSON) or [DONE].",
                        }
                    },
                }
            },
        },
    }
}


def _body(model: str) -> dict[str, Any]:
    """The OpenAPI request body (the route reads the raw body itself, strictly)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
        }
    }


def _header_episode(episode_id: str | None) -> str:
    if not episode_id:
        raise BadRequest(
            "no episode: use /episodes/{episode_id}/v1/... or send the X-Episode-Id header",
            param="X-Episode-Id",
        )
    if len(episode_id) > 200 or ID_PATTERN.fullmatch(episode_id) is None:
        raise BadRequest("X-Episode-Id is not an episode id", param="X-Episode-Id")
    return episode_id


async def _checked_body(request: Request, endpoint: Endpoint) -> dict[str, Any]:
    body = await read_json(request)
    checked = check_types(endpoint, body)
    check_n(body, request.app.state.settings.limits)
    if endpoint == "completions":
        ids = prompt_token_ids(getattr(checked, "prompt", None))
        if ids:
            check_token_ids(ids, None)  # negative ids, before asking the engine anything
            vocabulary: EngineVocabulary = request.app.state.vocabulary
            check_token_ids(ids, await vocabulary.size())
    assert isinstance(body, dict)
    return body


async def handle_capture(
    service: CaptureService, request: Request, episode_id: str | None, endpoint: Endpoint
) -> Response:
    """One generation request: its episode (the path's, else ``X-Episode-Id``), key, body, call."""
    if episode_id is None:
        episode_id = _header_episode(request.headers.get("x-episode-id"))
    await authorize_episode(request, episode_id)
    body = await _checked_body(request, endpoint)
    return openai_response(await capture_call(service, request, episode_id, endpoint, body))


async def _proxy(
    service: ServiceDep, request: Request, episode_id: str, endpoint: Endpoint
) -> Response:
    return await handle_capture(service, request, episode_id, endpoint)


@router.post(
    "/episodes/{episode_id}/v1/chat/completions",
    openapi_extra=_body("ChatCompletionBody"),
    responses=_COMPLETION_ANSWER,
)
async def chat(episode_id: EpisodeIdPath, service: ServiceDep, request: Request) -> Response:
    return await _proxy(service, request, episode_id, "chat")


@router.post(
    "/episodes/{episode_id}/v1/completions",
    openapi_extra=_body("CompletionBody"),
    responses=_COMPLETION_ANSWER,
)
async def completions(episode_id: EpisodeIdPath, service: ServiceDep, request: Request) -> Response:
    return await _proxy(service, request, episode_id, "completions")


@router.get("/episodes/{episode_id}/v1/models")
async def models(
    episode_id: EpisodeIdPath, service: ServiceDep, store: StoreDep, request: Request
) -> Response:
    await authorize_episode(request, episode_id)
    await store.get_episode(episode_id)
    return openai_response(await service.models())


@router.post(
    "/v1/chat/completions",
    openapi_extra=_body("ChatCompletionBody"),
    responses=_COMPLETION_ANSWER,
)
async def chat_by_header(
    service: ServiceDep, request: Request, x_episode_id: EpisodeHeader = None
) -> Response:
    return await _proxy(service, request, _header_episode(x_episode_id), "chat")


@router.post(
    "/v1/completions",
    openapi_extra=_body("CompletionBody"),
    responses=_COMPLETION_ANSWER,
)
async def completions_by_header(
    service: ServiceDep, request: Request, x_episode_id: EpisodeHeader = None
) -> Response:
    return await _proxy(service, request, _header_episode(x_episode_id), "completions")


@router.get("/v1/models")
async def models_by_header(
    service: ServiceDep, request: Request, x_episode_id: EpisodeHeader = None
) -> Response:
    await authorize_episode(request, x_episode_id and _header_episode(x_episode_id))
    return openai_response(await service.models())
