"""OpenAI Responses ⇄ the chat API the proxy captures (pure; no I/O).

Why translate instead of forwarding to vLLM's ``/v1/responses``: see
:mod:`capture_proxy.translate` (vLLM returns no token ids there). The proxy keeps no response
state: a request must carry its whole ``input`` (Codex sends ``store: false`` and the full
history every turn); ``previous_response_id`` is refused with a clear 400.

Request mapping:

- ``instructions`` → the first ``system`` message; ``input`` (a string: one user message; or
  items): ``message`` items by role (``developer`` → ``system``, as a chat template knows it;
  text parts ``input_text``/``output_text``/``text`` joined as parts), ``function_call`` items →
  the assistant's ``tool_calls`` (joined onto the assistant message right before them, so the
  history reads back exactly as the proxy answered it), ``function_call_output`` → ``tool``
  messages; ``reasoning`` items are not rendered.
- ``tools``: ``function`` tools map across; ``namespace`` tools (Codex's ``multi_agent_v1``)
  are flattened to their function tools, and a call of one is answered with its ``namespace``;
  hosted tools (web search, …) are dropped. ``tool_choice``, ``parallel_tool_calls``,
  ``max_output_tokens`` → ``max_tokens``, ``temperature``, ``top_p`` map across; ``store``,
  ``include``, ``reasoning``, ``prompt_cache_key``, ``client_metadata`` are not forwarded.

Answers: one ``response`` whose ``output`` is a ``message`` item (``output_text``) and one
``function_call`` item per tool call (``call_id`` = the engine's tool-call id); status
``completed``, or ``incomplete`` (``max_output_tokens``) on a length stop; ``usage`` from the
engine's counts. Streams: :mod:`capture_proxy.translate.responses_stream`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from capture_proxy.errors import BadRequest

Event = tuple[str, dict[str, Any]]
_TEXT_PARTS = {"input_text", "output_text", "text"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise BadRequest(message, param=param)


# -- request --------------------------------------------------------------------------------


def _message_text(content: Any, param: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    _require(isinstance(content, list), "message content must be a string or parts", param)
    return [
        str(part.get("text", ""))
        for part in content
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
    ]


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(
            str(p.get("text", "")) for p in output if isinstance(p, dict) and "text" in p
        )
    return json.dumps(output)


def _convert_item(item: Any, index: int, out: list[dict[str, Any]]) -> None:
    param = f"input.{index}"
    _require(isinstance(item, dict), "every input item must be an object", param)
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(str(item.get("role")))
        _require(
            role is not None, "message role must be user, assistant, system or developer", param
        )
        texts = [t for t in _message_text(item.get("content"), param) if t]
        content: Any = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        out.append({"role": role, "content": content if texts else ""})
    elif kind == "function_call":
        _require(isinstance(item.get("name"), str), "function_call needs a `name`", param)
        call = {
            "id": str(item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
            "type": "function",
            "function": {"name": item["name"], "arguments": str(item.get("arguments") or "{}")},
        }
        previous = out[-1] if out else None
        if previous is not None and previous["role"] == "assistant":
            previous.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append(
            {
                "role": "tool",
                "tool_call_id": str(item.get("call_id") or ""),
                "content": _output_text(item.get("output")),
            }
        )
    # reasoning, web_search_call, …: nothing a text model renders


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def tools_and_namespaces(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The chat tools, and the namespace of each function that came from a namespace tool."""
    if tools is None:
        return [], {}
    _require(isinstance(tools, list), "`tools` must be a list", "tools")
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for tool in tools:
        _require(isinstance(tool, dict), "every tool must be an object", "tools")
        if tool.get("type") == "function" and isinstance(tool.get("name"), str):
            out.append(_function_tool(tool))
        elif tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    out.append(_function_tool(inner))
                    namespaces[inner["name"]] = str(tool.get("name"))
    return out, namespaces


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice if choice in {"auto", "none", "required"} else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return None


def to_chat_request(body: Any) -> dict[str, Any]:
    """The chat request for a Responses request."""
    _require(isinstance(body, dict), "the request body must be a JSON object", "body")
    _require(isinstance(body.get("model"), str), "`model` is required", "model")
    _require(
        body.get("previous_response_id") is None,
        "previous_response_id is not supported: the proxy keeps no response state; "
        "send the whole conversation in `input` (store: false)",
        "previous_response_id",
    )
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        _require(isinstance(items, list) and bool(items), "`input` must be non-empty", "input")
        for index, item in enumerate(items):
            _convert_item(item, index, messages)
    _require(bool(messages), "the input has no renderable content", "input")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    tools, _ = tools_and_namespaces(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("parallel_tool_calls"), bool):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        _require(
            isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1,
            "`max_output_tokens` must be a positive integer",
            "max_output_tokens",
        )
        chat["max_tokens"] = limit
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stream = body.get("stream", False)
    _require(isinstance(stream, bool), "`stream` must be a boolean", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# -- answers --------------------------------------------------------------------------------


def response_id(chat_id: Any) -> str:
    text = str(chat_id or uuid.uuid4().hex)
    return f"resp_{text.removeprefix('chatcmpl-')}"


def usage(chat_usage: Any) -> dict[str, Any]:
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespace: str | None
) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


@dataclass(frozen=True, slots=True)
class Request:
    """What of the Responses request its answer echoes."""

    model: str
    namespaces: dict[str, str]
    echo: dict[str, Any]

    @classmethod
    def of(cls, body: dict[str, Any]) -> Request:
        _, namespaces = tools_and_namespaces(body.get("tools"))
        echo = {
            "instructions": body.get("instructions"),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None,
            "store": body.get("store", False),
            "metadata": body.get("metadata") or {},
        }
        return cls(str(body["model"]), namespaces, echo)

    def response(
        self, rid: str, created: int, status: str, output: list[dict[str, Any]], use: Any
    ) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": use,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            **self.echo,
        }


def from_chat_answer(answer: dict[str, Any], request: Request) -> dict[str, Any]:
    """The Responses answer for a whole chat completion (choice 0)."""
    rid = response_id(answer.get("id"))
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        output.append(
            call_item(
                f"fc_{uuid.uuid4().hex}",
                str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                name,
                str(function.get("arguments") or ""),
                "completed",
                request.namespaces.get(name),
            )
        )
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    created = int(answer.get("created") or time.time())
    return request.response(rid, created, status, output, usage(answer.get("usage")))
