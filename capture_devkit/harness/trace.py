"""What a scripted harness run did: one frozen record per call, one per episode.

Tests hold the captured store against these: the exact request each call sent (so it can be replayed
against vLLM or tokenised there), the call id the proxy answered with, and wall-clock order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from capture_contracts.vocabulary import Role

Mode = Literal["workers", "parent_only"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class CallTrace:
    """One chat completion the harness made through the proxy."""

    step: str  # script position, e.g. "worker-a.turn1", "parent.final"
    agent_id: str | None  # as sent in X-Agent-Id (None when the run is unlabelled)
    parent_agent_id: str | None
    role: Role
    call_id: str  # the proxy's X-Capture-Call-Id
    request: dict[str, Any]  # the exact JSON body sent (model, messages, tools, seed, ...)
    stream: bool
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    started_s: float  # time.monotonic() when sent
    ended_s: float  # time.monotonic() when the whole answer was received

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.request["messages"]
        return messages

    def assistant_message(self) -> dict[str, Any]:
        """The assistant message a harness appends to its history after this call."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_message() for call in self.tool_calls]
        return message


@dataclass(frozen=True, slots=True)
class EpisodeTrace:
    """One episode of the scripted harness, calls in the order they were sent."""

    episode_id: str
    group_id: str
    base_url: str
    mode: Mode
    seed: int
    labelled: bool
    calls: tuple[CallTrace, ...]

    def step(self, name: str) -> CallTrace:
        for call in self.calls:
            if call.step == name:
                return call
        raise KeyError(f"no step {name!r} in episode {self.episode_id}")

    def by_agent(self, agent: str) -> list[CallTrace]:
        """Calls of one script agent ("parent", "worker-a", …), labelled or not."""
        return [c for c in self.calls if c.step.split(".", 1)[0] == agent]

    def agents(self) -> list[str]:
        return list(dict.fromkeys(c.step.split(".", 1)[0] for c in self.calls))

    def call_ids(self) -> dict[str, str]:
        """step → call id."""
        return {c.step: c.call_id for c in self.calls}
