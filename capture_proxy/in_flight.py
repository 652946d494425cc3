"""One request the capture path serves, from its admission to its outcome, and what ends it early.

The capture service (``proxy.py``) keeps an :class:`InFlight` per request in its registry: a
close cancels an episode's entries upstream (``cancelled``), a client that leaves cancels its own
(``hung_up``), and the handler records each as ``cancelled`` with the reason that applies
(``CANCELLED_BY_CLOSE`` or ``CLIENT_DISCONNECTED``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from capture_contracts.vocabulary import CALL_ID_HEADER, CALL_IDS_HEADER
from capture_proxy.continuation import Plan
from capture_proxy.errors import ClientGone
from capture_proxy.metrics import CallTimer
from capture_proxy.outcomes import Answer


@dataclass(slots=True)
class InFlight:
    """One request being served by this process (one entry per request, all its choices)."""

    episode_id: str
    call_ids: list[str]
    timer: CallTimer  # metrics: upstream time and the proxy's overhead
    role: str
    agent_id: str | None
    task: asyncio.Task[Any]  # the engine's answer (whole) or stream (its headers)
    plan: Plan | None = None  # exact-token continuation (capture_proxy/continuation.py)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # by a close
    hung_up: bool = False  # the client left while the engine worked on the call


def client_left(entry: InFlight) -> None:
    """The client is gone: stop the engine's work on its call (a task already done ignores it)."""
    entry.hung_up = True
    entry.task.cancel()


def hung_up(entry: InFlight) -> bool:
    """The engine's request was cancelled because the client left — and only for that (the
    handler's own task is not being cancelled, e.g. by a shutdown)."""
    task = asyncio.current_task()
    return entry.hung_up and not entry.cancelled.is_set() and not (task and task.cancelling())


def gone(headers: Mapping[str, str]) -> Answer:
    """The answer to a client that has left (it reaches nobody; logs and tests see it)."""
    error = ClientGone("the client closed the connection; the call was cancelled")
    return Answer(error.to_body(), error.status_code, headers)


async def abandon(sending: asyncio.Task[Any], stream: bool) -> None:
    """Abort an engine request whose call was not admitted (a stream's response is closed)."""
    sending.cancel()
    with anyio.CancelScope(shield=True):
        try:
            response = await sending
        except BaseException:  # cancelled, or the engine's own error: nothing to keep
            return
        if stream:
            await response.aclose()


def call_headers(call_ids: list[str], request_id: str) -> dict[str, str]:
    """The headers that name a request's calls (``CALL_ID_HEADER``, ``CALL_IDS_HEADER``)."""
    return {CALL_ID_HEADER: request_id, CALL_IDS_HEADER: ",".join(call_ids)}
