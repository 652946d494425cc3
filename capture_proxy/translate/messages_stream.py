"""A chat completion stream → the Anthropic Messages event stream (pure; no I/O).

:class:`MessageStream` is fed the engine's chat chunks one at a time, as the proxy passes them on,
and answers the Messages events for each: ``message_start``, per block ``content_block_start`` →
``content_block_delta``… → ``content_block_stop``, then, from :meth:`MessageStream.finish`, which
the API layer calls only after the proxy's ``[DONE]`` (the call is committed, DESIGN §3),
``message_delta`` (stop reason, usage) and ``message_stop``. The request and whole-answer mapping
is :mod:`capture_proxy.translate.messages`'s.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.translate.messages import (
    Event,
    error_from_openai,
    message_id,
    stop_reason,
    usage,
)


@dataclass(slots=True)
class _Block:
    index: int
    kind: str  # "text" | "tool_use"
    tool_index: int | None = None
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class MessageStream:
    """Chat completion chunks in, Messages stream events out (choice 0)."""

    model: str
    started: bool = False
    blocks: int = 0
    open: _Block | None = None
    tool_used: bool = False
    finish_reason: str | None = None
    stop: Any = None
    last_usage: dict[str, Any] | None = None
    _tools: dict[int, _Block] = field(default_factory=dict)

    def _start(self, chunk: dict[str, Any]) -> list[Event]:
        self.started = True
        message: dict[str, Any] = {
            "id": message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage(chunk.get("usage")), "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        index, self.open = self.open.index, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _open(self, kind: str, block: dict[str, Any], tool_index: int | None = None) -> list[Event]:
        events = self._close()
        self.open = _Block(self.blocks, kind, tool_index)
        self.blocks += 1
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.open.index, "content_block": block},
            )
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        assert self.open is not None
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.open.index, "delta": delta},
        )

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.last_usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if int(choice.get("index", 0)) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self.open is None or self.open.kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or []:
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop = choice.get("stop_reason")
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        block = self._tools.get(index)
        if block is None:
            self.tool_used = True
            start: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": function.get("name") or "",
                "input": {},
            }
            events += self._open("tool_use", start, tool_index=index)
            assert self.open is not None
            block = self._tools[index] = self.open
        arguments = function.get("arguments")
        if arguments and self.open is block:
            block.arguments.append(arguments)
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def finish(self) -> list[Event]:
        """The events after the proxy's ``[DONE]`` (the call is committed)."""
        events: list[Event] = [] if self.started else self._start({})
        events += self._close()
        reason, sequence = stop_reason(self.finish_reason, self.stop, self.tool_used)
        final = usage(self.last_usage)
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": final,
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def error(self, body: Any) -> list[Event]:
        """An error reported inside the stream (OpenAI shape in, Anthropic's out)."""
        status = 502
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("type")
            status = (
                409 if code == "conflict_error" else 400 if code == "invalid_request_error" else 502
            )
        return [("error", error_from_openai(status, body))]
