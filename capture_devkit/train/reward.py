"""The toy task's rewards: the share of one character class in the free-text answers.

The answers are the workers' final answers and the parent's final answer (sampled freely; the
tool calls before them are grammar-forced). Each reward is a share in [0, 1], so a group's
rewards differ only by what the policy sampled.

``uppercase`` (default): uppercase letters / letters. A third of the tiny model's 4096 tokens
hold a capital, about a tenth of the letters it writes at first; the policy learns to write more
within minutes on CPU. ``digits`` (digits / non-space characters) is the issue's example, but the
tiny tokenizer has only 10 digit tokens (the initial policy writes ~0.1 % digits): too little
signal for a 20-iteration run, measured in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from capture_devkit.harness.trace import EpisodeTrace

ANSWER_STEPS = ("worker-a.answer", "worker-b.answer", "parent.final")


def digit_share(texts: Iterable[str]) -> float:
    """Digits / non-space characters over all texts (0 when there is no character)."""
    chars = [c for text in texts for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)


def uppercase_share(texts: Iterable[str]) -> float:
    """Uppercase letters / letters over all texts (0 when there is no letter)."""
    letters = [c for text in texts for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c.isupper() for c in letters) / len(letters)


REWARDS: dict[str, Callable[[Iterable[str]], float]] = {
    "uppercase": uppercase_share,
    "digits": digit_share,
}


def answers(trace: EpisodeTrace) -> list[str]:
    return [call.content or "" for call in trace.calls if call.step in ANSWER_STEPS]


def episode_reward(trace: EpisodeTrace, reward: str = "uppercase") -> float:
    return REWARDS[reward](answers(trace))
