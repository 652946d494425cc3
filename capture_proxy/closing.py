"""Closing an episode safely (DESIGN §3, MISSION step 5).

The episode stops admitting at once (``closing``); in-flight calls get up to ``wait_s`` to finish;
what remains is either reported (409, the episode stays ``closing``) or cancelled upstream and
recorded ``cancelled``. Only then is the episode ``closed`` — no admitted call is ever dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from capture_contracts.vocabulary import CANCELLED_BY_CLOSE, Mark
from capture_proxy.errors import BadRequest, Conflict
from capture_proxy.proxy import CaptureService
from capture_proxy.store.records import EpisodeInfo

CANCEL_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class CloseRequest:
    """How to close an episode: its reward, how long to wait, what to do with what remains."""

    reward: float
    wait_s: float = 0.0
    cancel_outstanding: bool = False
    discarded_calls: Collection[str] = field(default_factory=tuple)
    accepted_calls: Collection[str] = field(default_factory=tuple)


def _marks(request: CloseRequest) -> dict[str, Mark]:
    both = set(request.discarded_calls) & set(request.accepted_calls)
    if both:
        raise BadRequest(
            f"calls both discarded and accepted: {sorted(both)}", param="accepted_calls"
        )
    marks: dict[str, Mark] = dict.fromkeys(request.discarded_calls, "discarded")
    marks.update(dict.fromkeys(request.accepted_calls, "accepted"))
    return marks


async def _wait_outstanding(
    service: CaptureService, episode_id: str, timeout_s: float
) -> list[str]:
    deadline = time.monotonic() + timeout_s
    interval = service.settings.close_poll_interval_s
    while True:
        outstanding = await service.store.outstanding(episode_id)
        if not outstanding or time.monotonic() >= deadline:
            return outstanding
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


async def close_episode(
    service: CaptureService, episode_id: str, request: CloseRequest
) -> EpisodeInfo:
    store = service.store
    status = await store.begin_close(episode_id, request.reward, _marks(request))
    if status == "closed":
        return await store.get_episode(episode_id)
    outstanding = await _wait_outstanding(service, episode_id, request.wait_s)
    if outstanding and request.cancel_outstanding:
        await service.cancel_in_flight(episode_id)
        outstanding = await _wait_outstanding(service, episode_id, CANCEL_GRACE_S)
        # Calls served by another proxy process (or lost with it) are cancelled in the store;
        # that process finds them cancelled when it tries to record them.
        await store.finish(episode_id, outstanding, "cancelled", CANCELLED_BY_CLOSE)
        outstanding = await store.outstanding(episode_id)
    if outstanding or not await store.finish_close(episode_id):
        outstanding = outstanding or await store.outstanding(episode_id)
        raise Conflict(
            f"episode {episode_id!r} has {len(outstanding)} call(s) in flight; it stays closing."
            " Retry the close with a longer wait_s, or with cancel_outstanding=true.",
            code="calls_outstanding",
            outstanding_calls=outstanding,
        )
    return await store.get_episode(episode_id)
