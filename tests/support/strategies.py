"""Hypothesis strategy: random episodes as a harness would produce them.

A random script of actions over a few agents (some unlabelled): new roots, continuations of any
completed call (same agent or a fork by another), same-prompt retries, ``n=2`` requests,
duplicates (same prompt and output, any agent: parent ties), compactions (a compaction call, then
a rewritten root), auxiliary calls, failures and cancellations, with admissions and completions
interleaved and random harness marks. Tokens come either fresh or from a 4-token alphabet, so
accidental prefixes and identical sequences occur.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.support.builders import EpisodeBuilder

AGENTS = ("a", "b", "c", None)
ACTIONS = (
    "root",
    "continue",
    "continue",
    "continue",
    "fork",
    "retry",
    "duplicate",
    "n2",
    "compact",
    "auxiliary",
    "complete",
    "complete",
    "complete",
    "fail",
)


class _Script:
    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.b = EpisodeBuilder("ep-prop", group_id="g", reward=draw(st.sampled_from([1.0, -0.5])))
        self.pending: list[str] = []
        self.done: list[str] = []

    def tokens(self, min_size: int) -> list[int]:
        if self.draw(st.booleans()):
            return self.draw(st.lists(st.integers(0, 3), min_size=min_size, max_size=4))
        return self.b.fresh(self.draw(st.integers(min_size, 4)))

    def admit(self, prompt: list[int], agent: str | None, role: str = "policy") -> str:
        call_id = f"c{len(self.b.calls):03d}"
        self.b.admit(call_id, prompt, agent=agent, role=role)
        self.pending.append(call_id)
        return call_id

    def complete(self, call_id: str, tokens: list[int] | None = None) -> None:
        self.pending.remove(call_id)
        self.b.complete(call_id, self.tokens(1) if tokens is None else tokens)
        self.done.append(call_id)

    def pick_done(self) -> str:
        return self.draw(st.sampled_from(self.done))

    def step(self, action: str) -> None:
        b, draw = self.b, self.draw
        if action in {"continue", "fork", "retry", "duplicate", "n2", "compact"} and not self.done:
            action = "root"
        if action in {"complete", "fail"} and not self.pending:
            action = "root"
        if action == "root":
            self.admit(self.tokens(1), draw(st.sampled_from(AGENTS)))
        elif action in {"continue", "fork"}:
            x = self.pick_done()
            agent = (
                b.calls[x]["agent_id"] if action == "continue" else draw(st.sampled_from(AGENTS))
            )
            self.admit(b.full(x) + self.tokens(0), agent)
        elif action == "retry":
            x = self.pick_done()
            self.admit(list(b.calls[x]["prompt_token_ids"]), b.calls[x]["agent_id"])
        elif action == "duplicate":  # same prompt and same output as x, any agent: parent ties
            x = self.pick_done()
            twin = self.admit(list(b.calls[x]["prompt_token_ids"]), draw(st.sampled_from(AGENTS)))
            self.complete(twin, b.completion(x))
        elif action == "n2":
            x = self.pick_done()
            prompt, agent = b.full(x) + self.tokens(0), b.calls[x]["agent_id"]
            self.admit(prompt, agent)
            self.admit(prompt, agent)
        elif action == "compact":
            x = self.pick_done()
            agent = b.calls[x]["agent_id"]
            summary_call = self.admit(b.full(x) + self.tokens(1), agent, role="compaction")
            self.complete(summary_call)
            self.admit(self.tokens(1) + b.completion(summary_call), agent)
        elif action == "auxiliary":
            on_top = bool(self.done) and draw(st.booleans())
            base = b.full(self.pick_done()) if on_top else []
            self.admit(base + self.tokens(1), draw(st.sampled_from(AGENTS)), role="auxiliary")
        elif action == "complete":
            self.complete(draw(st.sampled_from(self.pending)))
        else:  # fail or cancel
            call_id = draw(st.sampled_from(self.pending))
            self.pending.remove(call_id)
            b.end(call_id, draw(st.sampled_from(["failed", "cancelled"])))


@st.composite
def episodes(draw: st.DrawFn, max_steps: int = 25) -> dict[str, Any]:
    """A random closed episode bundle (every call resolved)."""
    script = _Script(draw)
    for action in draw(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=max_steps)):
        script.step(action)
    while script.pending:
        script.complete(script.pending[0])
    for call in script.b.calls.values():
        call["mark"] = draw(st.sampled_from([None] * 8 + ["discarded", "accepted"]))
    bundle = script.b.bundle()
    order = draw(st.permutations(range(len(bundle["calls"]))))
    bundle["calls"] = [bundle["calls"][i] for i in order]
    return bundle
