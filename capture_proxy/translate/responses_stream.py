"""A chat completion stream → the OpenAI Responses event stream (pure; no I/O).

:class:`ResponseStream` is fed the engine's chat chunks one at a time, as the proxy passes them on:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` →
(``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done`` | ``response.function_call_arguments.delta``…,
``response.function_call_arguments.done``) → ``response.output_item.done``; then, from
:meth:`ResponseStream.finish`, which the API layer calls only on the proxy's ``[DONE]`` (the call
is committed, DESIGN §3), ``response.completed`` (or ``response.incomplete``). Every event has a
``sequence_number``. The request and whole-answer mapping, and the items both share, are
:mod:`capture_proxy.translate.responses`'s.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from capture_proxy.translate.responses import (
    Event,
    Request,
    call_item,
    message_item,
    response_id,
    usage,
)


@dataclass(slots=True)
class _Item:
    output_index: int
    item_id: str
    kind: str  # "message" | "function_call"
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


@dataclass(slots=True)
class ResponseStream:
    """Chat completion chunks in, Responses stream events out (choice 0)."""

    request: Request
    rid: str = ""
    created: int = 0
    sequence: int = 0
    items: list[_Item] = field(default_factory=list)
    open: _Item | None = None
    done: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    last_usage: dict[str, Any] | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return kind, event

    def _start(self, chunk: dict[str, Any]) -> list[Event]:
        self.rid = response_id(chunk.get("id"))
        self.created = int(chunk.get("created") or time.time())
        snapshot = self.request.response(self.rid, self.created, "in_progress", [], None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _item_done(self, item: _Item) -> dict[str, Any]:
        if item.kind == "message":
            return message_item(item.item_id, "".join(item.parts), "completed")
        return call_item(
            item.item_id,
            item.call_id,
            item.name,
            "".join(item.parts),
            "completed",
            self.request.namespaces.get(item.name),
        )

    def _close(self) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        done = self._item_done(item)
        self.done.append(done)
        events: list[Event] = []
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "message":
            text = "".join(item.parts)
            part = done["content"][0]
            events.append(
                self._event("response.output_text.done", **where, content_index=0, text=text)
            )
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, arguments="".join(item.parts)
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=item.output_index, item=done)
        )
        return events

    def _open(self, item: _Item, added: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.open = item
        self.items.append(item)
        events.append(
            self._event("response.output_item.added", output_index=item.output_index, item=added)
        )
        return events

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = [] if self.rid else self._start(chunk)
        if chunk.get("usage"):
            self.last_usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if int(choice.get("index", 0)) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open.kind != "message":
            item = _Item(len(self.items), f"msg_{uuid.uuid4().hex}", "message")
            events += self._open(item, message_item(item.item_id, "", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"item_id": item.item_id, "output_index": item.output_index}
            events.append(
                self._event("response.content_part.added", **where, content_index=0, part=part)
            )
        assert self.open is not None
        self.open.parts.append(text)
        where = {"item_id": self.open.item_id, "output_index": self.open.output_index}
        events.append(
            self._event(
                "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
            )
        )
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            item = _Item(
                len(self.items),
                f"fc_{uuid.uuid4().hex}",
                "function_call",
                call_id=str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                name=str(function.get("name") or ""),
            )
            self._calls[index] = item
            added = call_item(
                item.item_id,
                item.call_id,
                item.name,
                "",
                "in_progress",
                self.request.namespaces.get(item.name),
            )
            events += self._open(item, added)
        arguments = function.get("arguments")
        if arguments and self.open is item:
            item.parts.append(arguments)
            where = {"item_id": item.item_id, "output_index": item.output_index}
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=arguments)
            )
        return events

    def finish(self) -> list[Event]:
        """The events after the proxy's ``[DONE]`` (the call is committed)."""
        events: list[Event] = [] if self.rid else self._start({})
        events += self._close()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        final = self.request.response(
            self.rid, self.created, status, self.done, usage(self.last_usage)
        )
        events.append(self._event(f"response.{status}", response=final))
        return events

    def error(self, body: Any) -> list[Event]:
        """An error inside the stream: ``response.failed`` with the proxy's message."""
        events: list[Event] = [] if self.rid else self._start({})
        error = body.get("error") if isinstance(body, dict) else None
        message = str(error.get("message")) if isinstance(error, dict) else str(body)
        failed = self.request.response(self.rid, self.created, "failed", self.done, None)
        failed["error"] = {"code": "server_error", "message": message}
        events.append(self._event("response.failed", response=failed))
        return events
