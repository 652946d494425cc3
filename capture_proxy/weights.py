"""The policy version the proxy serves, and the gate that holds calls while the weights change.

Every captured call records the version of the weights that served it (``calls.weight_version``).
The version is taken when a call passes the gate, before admission, and the gate is closed only
while no call is in flight, so a call never straddles two versions::

    trainer:  POST /weights/pause   ── the gate closes: new calls wait (held, not failed) ──
                                     ── in-flight calls finish; the answer says "paused"    ──
              (reload the engine's weights: in place, or a restart behind the proxy)
              POST /weights/resume  {"weight_version": N | null}
                                     ── version := N (or the engine's /weight_info, or the ──
                                     ── proxy's own counter + 1); held calls are admitted  ──

A pause that is never resumed (the trainer died) expires after ``hold_limit_s``: the gate reopens
on the old version. One process: with several proxy processes sharing a store, pause each.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from capture_proxy.errors import Conflict


@dataclass(frozen=True, slots=True)
class WeightState:
    weight_version: int
    paused: bool
    in_flight: int  # calls past the gate and not finished
    held: int  # calls waiting at the gate


class WeightGate:
    """A version counter and a gate (one event loop; no locks needed between its awaits)."""

    def __init__(self, version: int = 0, *, hold_limit_s: float = 600.0) -> None:
        self.version = version
        self.hold_limit_s = hold_limit_s
        self._in_flight = 0
        self._held = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def state(self) -> WeightState:
        return WeightState(self.version, self.paused, self._in_flight, self._held)

    async def enter(self) -> int:
        """Wait while paused; count the call in flight; return the version that will serve it."""
        while not self._open.is_set():
            self._held += 1
            try:
                await self._open.wait()
            finally:
                self._held -= 1
        self._in_flight += 1
        self._drained.clear()
        return self.version

    def leave(self) -> None:
        """The call has finished (any outcome)."""
        self._in_flight -= 1
        if self._in_flight <= 0:
            self._in_flight = 0
            self._drained.set()

    async def pause(self, timeout_s: float) -> WeightState:
        """Close the gate and wait for in-flight calls; Conflict (gate reopened) on timeout."""
        if self.paused:
            raise Conflict("the weights are already paused", code="weights_paused")
        self._open.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        except TimeoutError:
            self._open.set()
            raise Conflict(
                f"{self._in_flight} call(s) still in flight after {timeout_s:g} s; not paused",
                code="weights_busy",
            ) from None
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_later(self.hold_limit_s, self._open.set)
        return self.state()

    def resume(self, version: int | None) -> WeightState:
        """Set the served version (default: the counter + 1) and reopen the gate."""
        if not self.paused:
            raise Conflict("the weights are not paused", code="weights_not_paused")
        new = self.version + 1 if version is None else version
        if new < self.version:
            raise Conflict(
                f"weight_version {new} is older than the served {self.version}",
                param="weight_version",
                code="weight_version_older",
            )
        self.version = new
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._open.set()
        return self.state()


def version_of(engine_version: object) -> int | None:
    """The engine's ``/weight_info`` version as an integer, when it is one (vLLM: a string)."""
    if isinstance(engine_version, bool):
        return None
    if isinstance(engine_version, int):
        return engine_version if engine_version >= 0 else None
    if isinstance(engine_version, str) and engine_version.isdigit():
        with contextlib.suppress(ValueError):
            return int(engine_version)
    return None
