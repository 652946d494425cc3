"""Anthropic Messages routes (Claude Code), per episode by path or by ``X-Episode-Id``.

``POST …/v1/messages`` (Claude Code adds ``?beta=true``; query parameters are ignored) is
translated to a chat call and captured by the chat path (:mod:`capture_proxy.api.edge`,
:mod:`capture_proxy.translate.messages` — why not vLLM's own ``/v1/messages``: it returns no
token ids). ``POST …/v1/messages/count_tokens`` counts with the engine's own tokenizer and chat
template (vLLM ``/tokenize`` with the translated messages and tools): the same prompt the
generation would condition on, minus nothing.

Every error on these routes has Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``, before or inside a stream.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from capture_contracts.errors import CaptureError
from capture_proxy.api.deps import ServiceDep
from capture_proxy.api.edge import capture_call, episode_of, json_body, translate
from capture_proxy.api.openai_schemas import MESSAGES_RESPONSES, TRANSLATED_ANSWER
from capture_proxy.errors import UpstreamError
from capture_proxy.proxy import CaptureService
from capture_proxy.translate import messages as tm
from capture_proxy.translate.messages_stream import MessageStream
from capture_proxy.upstream import TOKENIZE

router = APIRouter(tags=["anthropic"], responses={**MESSAGES_RESPONSES, **TRANSLATED_ANSWER})


def _anthropic_error(exc: CaptureError) -> JSONResponse:
    return JSONResponse(tm.error_body(exc.status_code, exc.message), status_code=exc.status_code)


async def _messages(service: CaptureService, request: Request, episode: str | None) -> Response:
    try:
        episode_id = await episode_of(request, episode)
        body = await json_body(request)
        chat = tm.to_chat_request(body)
        model = str(body["model"])
        outcome = await capture_call(service, request, episode_id, "chat", chat)
    except CaptureError as exc:
        return _anthropic_error(exc)
    return translate(
        outcome,
        whole=lambda answer: tm.from_chat_answer(answer, model),
        error=tm.error_from_openai,
        stream=lambda: MessageStream(model),
    )


async def _count_tokens(service: CaptureService, request: Request, episode: str | None) -> Response:
    try:
        await service.store.get_episode(await episode_of(request, episode))
        body = await json_body(request)
        chat = tm.to_chat_request(body, count_only=True)
        served = service.settings.upstream.served_model
        tokenize: dict[str, Any] = {
            "model": served or chat["model"],
            "messages": chat["messages"],
            "add_generation_prompt": True,
        }
        if chat.get("tools"):
            tokenize["tools"] = chat["tools"]
        reply = await service.upstream.post_json(TOKENIZE, tokenize)
        if reply.status_code >= 400:
            return JSONResponse(
                tm.error_from_openai(reply.status_code, reply.body), status_code=reply.status_code
            )
        count = reply.body.get("count") if isinstance(reply.body, dict) else None
        if not isinstance(count, int):
            raise UpstreamError("the engine's /tokenize answer has no `count`")
    except CaptureError as exc:
        return _anthropic_error(exc)
    return JSONResponse({"input_tokens": count})


@router.post("/episodes/{episode_id}/v1/messages")
async def messages(episode_id: str, service: ServiceDep, request: Request) -> Response:
    return await _messages(service, request, episode_id)


@router.post("/episodes/{episode_id}/v1/messages/count_tokens")
async def count_tokens(episode_id: str, service: ServiceDep, request: Request) -> Response:
    return await _count_tokens(service, request, episode_id)


@router.post("/v1/messages")
async def messages_by_header(service: ServiceDep, request: Request) -> Response:
    return await _messages(service, request, None)


@router.post("/v1/messages/count_tokens")
async def count_tokens_by_header(service: ServiceDep, request: Request) -> Response:
    return await _count_tokens(service, request, None)
