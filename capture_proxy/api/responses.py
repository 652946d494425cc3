"""OpenAI Responses routes (Codex), per episode by path or by ``X-Episode-Id``.

``POST …/v1/responses`` is translated to a chat call and captured by the chat path
(:mod:`capture_proxy.api.edge`, :mod:`capture_proxy.translate.responses` — why not vLLM's own
``/v1/responses``: it returns no token ids). Errors have the OpenAI shape, like every OpenAI
route; inside a stream a failure is a ``response.failed`` event.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from capture_proxy.api.deps import ServiceDep
from capture_proxy.api.edge import capture_call, episode_of, json_body, translate
from capture_proxy.api.openai_schemas import TRANSLATED_ANSWER, UPSTREAM_RESPONSES
from capture_proxy.proxy import CaptureService
from capture_proxy.translate import responses as tr
from capture_proxy.translate.responses_stream import ResponseStream

router = APIRouter(tags=["responses"], responses={**UPSTREAM_RESPONSES, **TRANSLATED_ANSWER})


def _openai_error(status_code: int, body: Any) -> dict[str, Any]:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    return {"error": {"message": str(body), "type": "upstream_error", "param": None, "code": None}}


async def _responses(service: CaptureService, request: Request, episode: str | None) -> Response:
    episode_id = await episode_of(request, episode)
    body = await json_body(request)
    chat = tr.to_chat_request(body)
    echo = tr.Request.of(body)
    outcome = await capture_call(service, request, episode_id, "chat", chat)
    return translate(
        outcome,
        whole=lambda answer: tr.from_chat_answer(answer, echo),
        error=_openai_error,
        stream=lambda: ResponseStream(echo),
    )


@router.post("/episodes/{episode_id}/v1/responses")
async def responses(episode_id: str, service: ServiceDep, request: Request) -> Response:
    return await _responses(service, request, episode_id)


@router.post("/v1/responses")
async def responses_by_header(service: ServiceDep, request: Request) -> Response:
    return await _responses(service, request, None)
