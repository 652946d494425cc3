"""One agent of a scripted harness: the official ``openai`` client, headers per agent.

Each agent gets its own :class:`openai.AsyncOpenAI` with ``default_headers`` (``X-Agent-Id``,
``X-Parent-Agent-Id``), exactly as a harness would configure a sub-agent. A step that must contain
a tool call forces the exact text with vLLM's ``structured_outputs`` regex (DESIGN §7); the engine
then returns real ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

from openai import AsyncOpenAI

from capture_contracts.vocabulary import CALL_ID_HEADER, Role
from capture_devkit.harness.trace import CallTrace, ToolCall

#: Free-text calls: enough tokens to say something, few enough to stay fast on CPU.
FREE_MAX_TOKENS = 24
FREE_MIN_TOKENS = 4


def tool_call_text(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The hermes text of tool calls, as the tiny model's chat template renders them."""
    return "\n".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in calls
    )


def forced_max_tokens(text: str) -> int:
    """Forced text may come out one byte per token (non-canonical splits), plus the end token."""
    return len(text.encode()) + 4


class AgentClient:
    """Makes one agent's calls and records each as a :class:`CallTrace`."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str,
        model: str,
        agent_id: str | None,
        parent_agent_id: str | None = None,
        api_key: str = "capture-harness",
        timeout_s: float = 300.0,
        free_max_tokens: int | None = None,
    ) -> None:
        headers: dict[str, str] = {}
        if agent_id is not None:
            headers["X-Agent-Id"] = agent_id
        if parent_agent_id is not None:
            headers["X-Parent-Agent-Id"] = parent_agent_id
        self.name = name
        self.model = model
        self.agent_id = agent_id
        self.parent_agent_id = parent_agent_id
        self.client = AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            default_headers=headers,
            max_retries=0,
            timeout=timeout_s,
        )
        self.free_max_tokens = free_max_tokens or FREE_MAX_TOKENS
        self.traces: list[CallTrace] = []

    async def close(self) -> None:
        await self.client.close()

    def _body(
        self,
        messages: list[dict[str, Any]],
        *,
        seed: int,
        tools: list[dict[str, Any]] | None,
        tool_choice: str | None,
        forced: str | None,
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "seed": seed}
        if tools:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if forced is not None:
            body["max_tokens"] = forced_max_tokens(forced)
            body["structured_outputs"] = {"regex": re.escape(forced)}
        else:
            body["max_tokens"] = self.free_max_tokens
            body["min_tokens"] = FREE_MIN_TOKENS
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def call(
        self,
        step: str,
        messages: list[dict[str, Any]],
        *,
        seed: int,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        forced: str | None = None,
        role: Role = "policy",
        stream: bool = False,
    ) -> CallTrace:
        """One chat completion through the proxy (the request body is kept verbatim)."""
        body = self._body(
            messages, seed=seed, tools=tools, tool_choice=tool_choice, forced=forced, stream=stream
        )
        standard = {
            "model",
            "messages",
            "seed",
            "tools",
            "tool_choice",
            "max_tokens",
            "stream",
            "stream_options",
        }
        kwargs = {k: v for k, v in body.items() if k in standard}
        extra = {k: v for k, v in body.items() if k not in standard}
        headers = {"X-Call-Role": role} if role != "policy" else {}
        started = time.monotonic()
        raw = await self.client.chat.completions.with_raw_response.create(
            **kwargs, extra_body=extra or None, extra_headers=headers or None
        )
        call_id = raw.headers.get(CALL_ID_HEADER, "")
        parsed = raw.parse()
        if stream:
            content, tool_calls, finish = await _drain(parsed)
        else:
            choice = parsed.choices[0]
            content = choice.message.content
            tool_calls = tuple(
                ToolCall(c.id, c.function.name, c.function.arguments)
                for c in choice.message.tool_calls or []
                if c.type == "function"
            )
            finish = choice.finish_reason
        trace = CallTrace(
            step=step,
            agent_id=self.agent_id,
            parent_agent_id=self.parent_agent_id,
            role=role,
            call_id=call_id,
            request=body,
            stream=stream,
            content=content,
            tool_calls=tool_calls,
            finish_reason=finish,
            started_s=started,
            ended_s=time.monotonic(),
        )
        if not call_id:
            raise RuntimeError(f"{step}: the proxy answered without {CALL_ID_HEADER}")
        if forced is not None and not tool_calls:
            raise RuntimeError(f"{step}: the forced tool call did not come back as tool_calls")
        self.traces.append(trace)
        return trace


async def _drain(stream: Any) -> tuple[str | None, tuple[ToolCall, ...], str | None]:
    """Accumulate a streamed answer: content text, tool-call deltas by index, finish reason."""
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish: str | None = None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text.append(delta.content)
            for part in delta.tool_calls or []:
                slot = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = part.id or slot["id"]
                if part.function is not None:
                    slot["name"] += part.function.name or ""
                    slot["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    tool_calls = tuple(
        ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())
    )
    return ("".join(text) if text else None), tool_calls, finish
