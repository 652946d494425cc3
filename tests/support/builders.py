"""Build episode bundles the way the proxy records them: one counter numbers every event."""

from __future__ import annotations

from typing import Any

from capture_contracts.bundle import SCHEMA


def logprob_of(token: int, position: int) -> float:
    """A deterministic, exactly representable behaviour logprob."""
    return -0.125 * (1 + (token * 7 + position) % 16)


class EpisodeBuilder:
    """Admit and complete calls in event order; ``fresh(n)`` hands out unused token ids."""

    def __init__(self, episode_id: str = "ep", group_id: str = "task", reward: float = 1.0):
        self.episode_id = episode_id
        self.group_id = group_id
        self.reward = reward
        self.seq = 0
        self.next_token = 10
        self.calls: dict[str, dict[str, Any]] = {}

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return out

    def admit(
        self,
        call_id: str,
        prompt: list[int],
        *,
        agent: str | None = None,
        parent_agent: str | None = None,
        role: str = "policy",
        mark: str | None = None,
    ) -> str:
        self.seq += 1
        self.calls[call_id] = {
            "call_id": call_id,
            "agent_id": agent,
            "parent_agent_id": parent_agent,
            "role": role,
            "status": "admitted",
            "mark": mark,
            "admitted_seq": self.seq,
            "completed_seq": None,
            "finish_reason": None,
            "prompt_token_ids": list(prompt),
            "completion_token_ids": [],
            "completion_logprobs": [],
        }
        return call_id

    def complete(self, call_id: str, completion: list[int] | int = 3) -> list[int]:
        """Complete with the given tokens (or that many fresh ones); returns prompt+completion."""
        tokens = self.fresh(completion) if isinstance(completion, int) else list(completion)
        self.seq += 1
        call = self.calls[call_id]
        call.update(
            status="completed",
            completed_seq=self.seq,
            finish_reason="stop",
            completion_token_ids=tokens,
            completion_logprobs=[logprob_of(t, i) for i, t in enumerate(tokens)],
        )
        return self.full(call_id)

    def end(self, call_id: str, status: str) -> None:
        """Fail or cancel an admitted call."""
        self.seq += 1
        self.calls[call_id].update(status=status, completed_seq=self.seq)

    def call(self, call_id: str, prompt: list[int], completion: list[int] | int = 3,
             **kw: Any) -> list[int]:  # fmt: skip
        self.admit(call_id, prompt, **kw)
        return self.complete(call_id, completion)

    def full(self, call_id: str) -> list[int]:
        call = self.calls[call_id]
        return [*call["prompt_token_ids"], *call["completion_token_ids"]]

    def completion(self, call_id: str) -> list[int]:
        return list(self.calls[call_id]["completion_token_ids"])

    def bundle(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "status": "closed",
            "reward": self.reward,
            "calls": list(self.calls.values()),
        }
