"""Reconstruction benchmark: token efficiency and scaling.

    .venv/bin/python benchmarks/bench_reconstruct.py [--quick]

1. Token efficiency = training tokens emitted (tokens of the rows) / tokens of the per-call
   reference layout (one row per eligible call: prompt + completion), for a 50-turn single agent
   and for a parent with 4 workers of 20 turns each.
2. Reconstruction time vs. number of calls, for single-agent chains (tokens grow ~ calls²) and for
   forests of 20-turn workers (tokens grow ~ calls): time per token should stay roughly flat,
   i.e. the cost is linear in total tokens. Timed on parsed bundles (the core, not JSON decoding),
   best of 3.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from capture_contracts.bundle import SCHEMA
from reconstruct import EpisodeBundle, parse_bundle, reconstruct_episode

SYSTEM, COMPLETION, TOOL_RESULT = 200, 60, 100


class _Episode:
    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id
        self.seq = 0
        self.token = 0
        self.calls: list[dict[str, Any]] = []

    def fresh(self, n: int) -> list[int]:
        self.token += n
        return [t % 50_000 for t in range(self.token - n, self.token)]

    def call(self, prompt: list[int], agent: str, n_out: int = COMPLETION) -> list[int]:
        out = self.fresh(n_out)
        self.calls.append(
            {
                "call_id": f"c{len(self.calls):06d}",
                "agent_id": agent,
                "parent_agent_id": None,
                "role": "policy",
                "status": "completed",
                "mark": None,
                "admitted_seq": self.seq + 1,
                "completed_seq": self.seq + 2,
                "finish_reason": "stop",
                "prompt_token_ids": prompt,
                "completion_token_ids": out,
                "completion_logprobs": [-0.5] * len(out),
            }
        )
        self.seq += 2
        return prompt + out

    def chain(self, agent: str, turns: int, first_prompt: list[int]) -> list[int]:
        """``turns`` calls, each continuing the last with a tool result; returns the last answer."""
        ctx = first_prompt
        answer: list[int] = []
        for turn in range(turns):
            full = self.call(ctx, agent)
            answer = full[-COMPLETION:]
            if turn < turns - 1:
                ctx = full + self.fresh(TOOL_RESULT)
        return answer

    def bundle(self) -> EpisodeBundle:
        return parse_bundle(
            {
                "schema": SCHEMA,
                "episode_id": self.episode_id,
                "group_id": "bench",
                "status": "closed",
                "reward": 1.0,
                "calls": self.calls,
            }
        )


def single_agent(turns: int) -> EpisodeBundle:
    ep = _Episode(f"single-{turns}")
    ep.chain("agent", turns, ep.fresh(SYSTEM))
    return ep.bundle()


def parent_with_workers(workers: int, turns: int) -> EpisodeBundle:
    ep = _Episode(f"workers-{workers}x{turns}")
    full_p1 = ep.call(ep.fresh(SYSTEM), "parent")
    answers = [ep.chain(f"w{i}", turns, ep.fresh(SYSTEM)) for i in range(workers)]
    ep.call(full_p1 + [t for a in answers for t in a], "parent")
    return ep.bundle()


def _reference_tokens(bundle: EpisodeBundle) -> int:
    # the per-call layout; identical to reconstruct.reference.reference_rows for these episodes
    # (no discards), computed directly because the naive reference is quadratic in calls
    return sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in bundle.calls)


def efficiency(name: str, bundle: EpisodeBundle) -> None:
    result = reconstruct_episode(bundle)
    acc = result.accounting
    ref = _reference_tokens(bundle)
    assert acc.reference_tokens == ref
    print(
        f"{name:<34} calls={acc.n_calls:>4} rows={acc.rows:>2} row_tokens={acc.row_tokens:>8,} "
        f"reference_tokens={ref:>10,} efficiency={acc.row_tokens / ref:6.3f} "
        f"(owned {acc.owned_tokens:,})"
    )


def _timed(bundle: EpisodeBundle, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reconstruct_episode(bundle)
        best = min(best, time.perf_counter() - start)
    return best


def scaling(label: str, bundles: list[EpisodeBundle]) -> None:
    print(f"\n{label}")
    print(f"{'calls':>7} {'total tokens':>14} {'time (ms)':>10} {'µs/call':>9} {'ns/token':>9}")
    for bundle in bundles:
        tokens = _reference_tokens(bundle)
        seconds = _timed(bundle)
        n = len(bundle.calls)
        print(
            f"{n:>7} {tokens:>14,} {seconds * 1e3:>10.1f} {seconds / n * 1e6:>9.1f} "
            f"{seconds / tokens * 1e9:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scaling sweep")
    args = parser.parse_args()

    print("Token efficiency (training tokens emitted / per-call reference tokens)")
    print(f"  (system prompt {SYSTEM}, completion {COMPLETION}, tool result {TOOL_RESULT} tokens)")
    efficiency("single agent, 50 turns", single_agent(50))
    efficiency("parent + 4 workers x 20 turns", parent_with_workers(4, 20))

    chain_sizes = [25, 50, 100, 200] if args.quick else [50, 100, 200, 400, 800]
    scaling("Single-agent chains (tokens ~ calls^2)", [single_agent(n) for n in chain_sizes])
    worker_counts = [2, 8, 32] if args.quick else [4, 16, 64, 256]
    scaling(
        "Parent + W workers x 20 turns (tokens ~ calls)",
        [parent_with_workers(w, 20) for w in worker_counts],
    )


if __name__ == "__main__":
    main()
