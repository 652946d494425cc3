"""Scripted harnesses: drive the proxy with the official ``openai`` client, following a script."""

from capture_devkit.harness.client import AgentClient, tool_call_text
from capture_devkit.harness.scripted import (
    DEFAULT_SCRIPT,
    EpisodeScript,
    WorkerScript,
    close_episode,
    fetch_bundle,
    open_episode,
    run_episode,
    step_seed,
)
from capture_devkit.harness.trace import CallTrace, EpisodeTrace, ToolCall

__all__ = [
    "DEFAULT_SCRIPT",
    "AgentClient",
    "CallTrace",
    "EpisodeScript",
    "EpisodeTrace",
    "ToolCall",
    "WorkerScript",
    "close_episode",
    "fetch_bundle",
    "open_episode",
    "run_episode",
    "step_seed",
    "tool_call_text",
]
