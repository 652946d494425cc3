"""Anthropic Messages ⇄ the chat API the proxy captures (pure; no I/O).

Why translate instead of forwarding to vLLM's ``/v1/messages``: see :mod:`capture_proxy.translate`
(vLLM returns no token ids there). The request mapping follows vLLM 0.32's own Messages server
(``vllm.entrypoints.anthropic.serving``), so a prompt renders as the engine would render it:

- ``system`` (string or text blocks) → the first ``system`` message, blocks joined as they are;
  Claude Code's ``x-anthropic-billing-header`` block is dropped (it carries a per-request hash
  that would change every prompt's first tokens). Inline ``role: system`` messages (Claude Code's
  mid-conversation reminders) stay in place as ``system`` messages.
- ``text`` blocks → content (one block: a string; several: text parts); ``tool_use`` → the
  assistant's ``tool_calls`` (same id, ``input`` as JSON arguments); ``tool_result`` → a ``tool``
  message (text joined by newlines) before the rest of the user turn; ``thinking`` blocks are
  not rendered (the tiny template has no reasoning; vLLM passes them as ``reasoning``).
- ``tools`` (client tools with ``input_schema``) → function tools; server tools are dropped;
  ``tool_choice`` auto/any/tool/none → auto/required/named/none.
- ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` map across;
  ``metadata``, ``thinking``, ``context_management``, ``output_config``, ``cache_control`` are
  accepted and not forwarded (the engine has no use for them).

Answers: a whole chat completion becomes one ``message`` (text block, then ``tool_use`` blocks;
``stop_reason`` ``end_turn``/``tool_use``/``max_tokens``/``stop_sequence``; ``usage`` from the
engine's counts). A chat stream becomes the Messages event sequence
(:mod:`capture_proxy.translate.messages_stream`), whose last two events follow the proxy's
``[DONE]``, i.e. the call's commit (DESIGN §3).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from capture_proxy.errors import BadRequest

BILLING_HEADER = "x-anthropic-billing-header"
Event = tuple[str, dict[str, Any]]  # (SSE event name, data)

#: Our error types → Anthropic's (``{"type": "error", "error": {"type", "message"}}``).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for an HTTP status."""
    kind = _ERROR_TYPES.get(
        status_code, "api_error" if status_code >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_from_openai(status_code: int, body: Any) -> dict[str, Any]:
    """Anthropic's shape for an OpenAI-style error body (the proxy's or the engine's)."""
    message = ""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = str(error.get("message") or "")
        elif error is not None:
            message = str(error)
        message = message or str(body.get("message") or body.get("detail") or "")
    return error_body(status_code, message or f"upstream error {status_code}")


# -- request --------------------------------------------------------------------------------


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise BadRequest(message, param=param)


def _text(block: Any, param: str) -> str | None:
    """The text of a text block (``None`` for the billing header)."""
    _require(isinstance(block, dict), "content blocks must be objects", param)
    text = block.get("text")
    _require(isinstance(text, str), "a text block needs a string `text`", param)
    return None if text.startswith(BILLING_HEADER) else text


def system_text(system: Any) -> str:
    """``system`` as one string (text blocks joined as vLLM joins them)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    _require(isinstance(system, list), "`system` must be a string or a list of blocks", "system")
    parts = [_text(b, "system") for b in system if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(p for p in parts if p)


def _content(parts: list[str]) -> str | list[dict[str, str]]:
    return parts[0] if len(parts) == 1 else [{"type": "text", "text": p} for p in parts]


def _tool_result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", ""))
            for item in content
            if isinstance(item, dict) and item.get("type") == "text"
        )
    return json.dumps(content)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    _require(isinstance(block.get("name"), str), "tool_use needs a `name`", param)
    return {
        "id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
        "type": "function",
        "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})},
    }


def _blocks(
    content: list[Any], param: str, out: list[dict[str, Any]]
) -> tuple[list[str], list[dict[str, Any]]]:
    """A turn's texts and tool calls; its tool results go to ``out`` as ``tool`` messages."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        _require(isinstance(block, dict) and "type" in block, "blocks need a `type`", param)
        kind = block["type"]
        if kind == "text":
            text = _text(block, param)
            if text:
                texts.append(text)
        elif kind == "tool_use":
            calls.append(_tool_use(block, param))
        elif kind == "tool_result":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id") or ""),
                    "content": _tool_result_text(block.get("content")),
                }
            )
        # thinking, redacted_thinking, images, documents…: not rendered by a text model
    return texts, calls


def _convert_turn(message: Any, index: int, out: list[dict[str, Any]]) -> None:
    param = f"messages.{index}"
    _require(isinstance(message, dict), "every message must be an object", param)
    role = message.get("role")
    _require(role in {"user", "assistant", "system"}, "role must be user or assistant", param)
    content = message.get("content")
    if isinstance(content, str):
        if role != "system" or not content.startswith(BILLING_HEADER):
            out.append({"role": role, "content": content})
        return
    _require(isinstance(content, list), "`content` must be a string or a list of blocks", param)
    texts, calls = _blocks(content, param, out)
    if role == "system":
        if texts:
            out.append({"role": "system", "content": "".join(texts)})
        return
    turn: dict[str, Any] = {"role": role}
    if texts:
        turn["content"] = _content(texts)
    if calls:
        turn["tool_calls"] = calls
        turn.setdefault("content", None)
    if texts or calls:
        out.append(turn)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    _require(isinstance(tools, list), "`tools` must be a list", "tools")
    out = []
    for tool in tools:
        _require(isinstance(tool, dict) and isinstance(tool.get("name"), str), "bad tool", "tools")
        if "input_schema" not in tool:  # a server tool (web search, …): the engine runs none
            continue
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return kind if kind in {"auto", "none"} else None


def to_chat_request(body: Any, *, count_only: bool = False) -> dict[str, Any]:
    """The chat request for a Messages request (or a ``count_tokens`` request)."""
    _require(isinstance(body, dict), "the request body must be a JSON object", "body")
    _require(isinstance(body.get("model"), str), "`model` is required", "model")
    messages = body.get("messages")
    _require(
        isinstance(messages, list) and bool(messages), "`messages` must be non-empty", "messages"
    )
    chat_messages: list[dict[str, Any]] = []
    system = system_text(body.get("system"))
    if system:
        chat_messages.append({"role": "system", "content": system})
    for index, message in enumerate(messages):
        _convert_turn(message, index, chat_messages)
    _require(bool(chat_messages), "the messages have no renderable content", "messages")
    chat: dict[str, Any] = {"model": body["model"], "messages": chat_messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get(
            "disable_parallel_tool_use"
        ):
            chat["parallel_tool_calls"] = False
    if count_only:
        return chat
    max_tokens = body.get("max_tokens")
    _require(
        isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1,
        "`max_tokens` must be a positive integer",
        "max_tokens",
    )
    chat["max_tokens"] = max_tokens
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stream = body.get("stream", False)
    _require(isinstance(stream, bool), "`stream` must be a boolean", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# -- answers --------------------------------------------------------------------------------


def message_id(chat_id: Any) -> str:
    text = str(chat_id or uuid.uuid4().hex)
    return text if text.startswith("msg_") else f"msg_{text.removeprefix('chatcmpl-')}"


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: Any, stop: Any, tool_used: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_used or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(chat_usage: Any) -> dict[str, int]:
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    return {
        "input_tokens": int(chat_usage.get("prompt_tokens") or 0),
        "output_tokens": int(chat_usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def from_chat_answer(answer: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages answer for a whole chat completion (choice 0)."""
    choice = (answer.get("choices") or [{}])[0]
    message: dict[str, Any] = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments") or ""),
            }
        )
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
    )
    return {
        "id": message_id(answer.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(answer.get("usage")),
    }
