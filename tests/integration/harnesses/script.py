"""TEST-ONLY scripted engine output: a request-transform hook (``UpstreamSettings.transform``)
that forces, per (agent, turn), the exact text the real tiny model emits.

Real harness, real proxy, real vLLM — only the choice of text is scripted: each policy call gets
a vLLM ``structured_outputs`` regex of its step's text (hermes ``<tool_call>`` blocks become real
``tool_calls``), compaction and title calls get a fixed short text. Agents are keyed without
harness changes: a call without a parent agent is ``"parent"``; a subagent is keyed by the first
marker (of ``children``) found in its first request's user messages, remembered per agent id.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture_devkit.harness.client import forced_max_tokens, tool_call_text
from capture_proxy.attribution import Attribution

SUMMARY_TEXT = "Summary: shelf counted, keep going."
TITLE_TEXT = "Fruit count"
FALLBACK_TEXT = "Done."


@dataclass(frozen=True, slots=True)
class Step:
    """One model answer: tool calls (made in one step, concurrently by the harness) or text."""

    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    text: str = ""
    #: The step chosen from the request (what the harness told the model so far, e.g. which of
    #: Codex's sub-agents have reported back).
    dynamic: Callable[[dict[str, Any]], Step] | None = None

    def forced(self, body: dict[str, Any]) -> str:
        if self.dynamic is not None:
            return self.dynamic(body).forced(body)
        return tool_call_text(self.calls) if self.calls else self.text


def say(text: str) -> Step:
    return Step(text=text)


def call(*calls: tuple[str, dict[str, Any]]) -> Step:
    return Step(calls=tuple(calls))


@dataclass
class ScriptedEngine:
    steps: Mapping[str, Sequence[Step]]
    children: Mapping[str, str] = field(default_factory=dict)  # marker in first message → key
    summary_text: str = SUMMARY_TEXT  # a compaction call's answer
    seen: list[tuple[str, int, str]] = field(default_factory=list)  # (key, turn, role)
    requests: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    _keys: dict[str, str] = field(default_factory=dict)
    _turns: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _key(self, body: Mapping[str, Any], attribution: Attribution) -> str:
        agent = attribution.agent_id or "-"
        if agent in self._keys:
            return self._keys[agent]
        key = "parent"
        if attribution.parent_agent_id is not None:
            # The marker is in the agent's task: its first user message (OpenCode, Claude Code)
            # or a later one (Codex puts its environment context first).
            first = " ".join(
                str(m.get("content")) for m in body.get("messages", []) if m.get("role") == "user"
            )
            key = next((k for marker, k in self.children.items() if marker in first), "child?")
        self._keys[agent] = key
        return key

    def key_of(self, agent_id: str | None) -> str:
        """The script key an agent was given (calls are admitted in a different order than the
        hook sees them when planning awaits the engine: map by agent, not by position)."""
        with self._lock:
            return self._keys[agent_id or "-"]

    def __call__(self, body: dict[str, Any], attribution: Attribution) -> dict[str, Any]:
        with self._lock:
            key = self._key(body, attribution)
            if attribution.role == "compaction":
                text, turn = self.summary_text, -1
            elif attribution.role == "auxiliary":
                text, turn = TITLE_TEXT, -1
            else:
                turn = self._turns[key]
                self._turns[key] += 1
                script = self.steps.get(key, ())
                text = script[turn].forced(body) if turn < len(script) else FALLBACK_TEXT
            self.seen.append((key, turn, attribution.role))
            self.requests.append((key, turn, body))
        return {
            **body,
            "structured_outputs": {"regex": re.escape(text)},
            "max_tokens": forced_max_tokens(text),
            "temperature": 1.0,
            # No `seed`: vLLM 0.32 on CPU kills its engine when a seeded request's prompt needs
            # chunked prefill (OpenCode's ~11k-token prompts do); forced text needs none.
        }
