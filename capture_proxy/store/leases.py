"""Instance leases: every proxy process owns the calls it admits, and nothing it leaves is lost.

Each run of a proxy process is an *instance*: a row in ``instances`` with a unique
``instance_id``, a ``name`` that stays the same across restarts (``host:port`` under
``capture-proxy serve``) and a lease (``expires_at``, by the store's clock) that the instance
renews every ``lease_s / 3`` seconds. Every call it admits carries its ``instance_id``.

An instance's unresolved (``admitted``) calls become ``failed`` with the reason
``proxy_restart`` — never ``completed``, never left in flight — when

- a new run of the same name starts (the old run is dead: two processes cannot serve one
  host and port), at once, in the new run's registration;
- its lease runs out (the process was killed, or its host vanished): any live instance's next
  heartbeat resolves them, so orphans are resolved within ``lease_s + lease_s / 3`` seconds as
  long as one instance runs;
- it stops cleanly with calls still unresolved (the server's own shutdown normally settles them).

Completed calls are never touched. Sweeping is a conditional update (``WHERE status =
'admitted'``), so it can race a completion and only one of them wins. An instance whose lease was
taken while it was still alive (a heartbeat late by more than the lease) finds out at its next
heartbeat or admission, logs it and takes a new lease; the calls already resolved stay resolved
(their completions are refused and the harness is told). Admissions check the instance's own
lease in their transaction (on PostgreSQL an update of its row, which locks it — in the same
statement as the admission when it is one; on SQLite a read, under the store-wide write lock),
so a call is never admitted under a lease that a concurrent sweep is ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from capture_contracts.vocabulary import PROXY_RESTART
from capture_proxy.errors import CaptureProxyError
from capture_proxy.store.operations import Db

log = logging.getLogger(__name__)
T = TypeVar("T")

#: ``live`` holds a lease; ``expired`` lost it (swept by another instance); ``replaced`` was
#: succeeded by a new run of the same name; ``stopped`` ended cleanly.
InstanceState = Literal["live", "expired", "replaced", "stopped"]

_INSERT = (
    "INSERT INTO instances (instance_id, name, state, host, pid, started_at, expires_at,"
    " resolved_calls) VALUES (:instance_id, :name, 'live', :host, :pid, :now, :expires_at, 0)"
)
_RENEW = (
    "UPDATE instances SET expires_at = :expires_at WHERE instance_id = :instance_id"
    " AND state = 'live'"
)
_REVIVE = (
    "UPDATE instances SET state = 'live', expires_at = :expires_at, ended_at = NULL"
    " WHERE instance_id = :instance_id"
)
# A no-op update: takes the row's lock (PostgreSQL) and tells whether the lease still holds.
_HOLDS = "UPDATE instances SET state = 'live' WHERE instance_id = :instance_id AND state = 'live'"
# The same under a store-wide write lock (SQLite), without rewriting the row's page.
_HOLDS_READ = "SELECT 1 FROM instances WHERE instance_id = :instance_id AND state = 'live'"
_SAME_NAME = (
    "SELECT instance_id FROM instances WHERE name = :name AND state = 'live'"
    " AND instance_id <> :instance_id"
)
_EXPIRED = (
    "SELECT instance_id FROM instances WHERE state = 'live' AND expires_at < :clock"
    " AND instance_id <> :instance_id"
)
_END = (
    "UPDATE instances SET state = :state, ended_at = :now WHERE instance_id = :instance_id"
    " AND state = 'live'"
)
_FAIL_CALLS = (
    "UPDATE calls SET status = 'failed', error = :error, completed_at = :now"
    " WHERE instance_id = :instance_id AND status = 'admitted'"
)
_COUNT_RESOLVED = (
    "UPDATE instances SET resolved_calls = resolved_calls + :n WHERE instance_id = :instance_id"
)


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    """Who this process is in the store: a unique id per run, a name kept across restarts."""

    instance_id: str
    name: str
    host: str
    pid: int

    @classmethod
    def new(cls, name: str | None = None) -> InstanceIdentity:
        """A fresh identity; without a name the run has its own (no restart takes it over)."""
        instance_id = f"in_{uuid.uuid4().hex[:20]}"
        host = socket.gethostname()
        return cls(instance_id, name or f"{host}:{instance_id}", host, os.getpid())


@dataclass(frozen=True, slots=True)
class Resolved:
    """What one registration, heartbeat or sweep did."""

    instances: tuple[str, ...] = ()  # the instances whose leases ended here
    calls: int = 0  # their unresolved calls, now failed (proxy_restart)
    lease_lost: bool = False  # this instance's own lease had been taken (and is renewed now)


def _end(db: Db, instance_id: str, state: InstanceState) -> int:
    """End an instance's lease (if it still holds) and fail its unresolved calls."""
    now = db.now()
    db.run(_END, {"instance_id": instance_id, "state": state, "now": now})
    failed = db.run(_FAIL_CALLS, {"instance_id": instance_id, "error": PROXY_RESTART, "now": now})
    if failed:
        db.run(_COUNT_RESOLVED, {"instance_id": instance_id, "n": failed})
    return failed


def _sweep_expired(db: Db, me: InstanceIdentity, clock: float) -> Resolved:
    expired = [r[0] for r in db.rows(_EXPIRED, {"clock": clock, "instance_id": me.instance_id})]
    calls = sum(_end(db, instance_id, "expired") for instance_id in expired)
    return Resolved(tuple(expired), calls)


def _insert(db: Db, me: InstanceIdentity, expires_at: float) -> None:
    row = {"instance_id": me.instance_id, "name": me.name, "host": me.host, "pid": me.pid}
    db.run(_INSERT, {**row, "now": db.now(), "expires_at": expires_at})


def _take_anew(db: Db, me: InstanceIdentity, expires_at: float) -> bool:
    """Take the lease again after it was lost (True), or for the first time (False: it was never
    recorded, because the store was away at start-up or nothing registered this instance)."""
    if db.run(_REVIVE, {"instance_id": me.instance_id, "expires_at": expires_at}) == 1:
        return True
    _insert(db, me, expires_at)
    return False


def register(db: Db, me: InstanceIdentity, lease_s: float) -> Resolved:
    """Take a lease; end the earlier runs of this name and every expired lease."""
    clock = db.clock()
    previous = [r[0] for r in db.rows(_SAME_NAME, {"name": me.name, "instance_id": me.instance_id})]
    calls = sum(_end(db, instance_id, "replaced") for instance_id in previous)
    _take_anew(db, me, clock + lease_s)
    swept = _sweep_expired(db, me, clock)
    return Resolved(tuple(previous) + swept.instances, calls + swept.calls)


def heartbeat(db: Db, me: InstanceIdentity, lease_s: float) -> Resolved:
    """Renew this instance's lease (taking a new one if it was lost); sweep expired leases."""
    clock = db.clock()
    renewed = db.run(_RENEW, {"instance_id": me.instance_id, "expires_at": clock + lease_s})
    lost = not renewed and _take_anew(db, me, clock + lease_s)
    swept = _sweep_expired(db, me, clock)
    return Resolved(swept.instances, swept.calls, lease_lost=lost)


def hold(db: Db, me: InstanceIdentity, lease_s: float) -> bool:
    """In an admission's transaction: False when the lease had been lost (it is taken anew)."""
    mine = {"instance_id": me.instance_id}
    if (db.run(_HOLDS, mine) == 1) if db.row_locks else bool(db.rows(_HOLDS_READ, mine)):
        return True
    return not _take_anew(db, me, db.clock() + lease_s)


def retire(db: Db, me: InstanceIdentity) -> int:
    """A clean stop: the lease ends; calls still unresolved fail (``proxy_restart``)."""
    return _end(db, me.instance_id, "stopped")


class LeaseWriter(Protocol):
    """What the lease needs of the store's writer (``Writer.lease_op``)."""

    async def lease_op(self, apply: Callable[[Db], T]) -> T: ...


class InstanceLease:
    """Registers this process, renews its lease in the background, retires it on stop."""

    def __init__(
        self,
        writer: LeaseWriter,
        identity: InstanceIdentity,
        lease_s: float,
        on_resolved: Callable[[int], None] | None = None,
    ) -> None:
        """``on_resolved(n)``: told of every ``n`` orphans this instance resolved (metrics)."""
        if lease_s <= 0:
            raise CaptureProxyError(f"the lease must be positive, not {lease_s}")
        self.writer = writer
        self.identity = identity
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.resolved_calls = 0  # orphans this instance resolved (metrics, logs)
        self._on_resolved = on_resolved
        self._task: asyncio.Task[None] | None = None
        self._registered = False

    def _note(self, what: str, resolved: Resolved) -> None:
        self.resolved_calls += resolved.calls
        if self._on_resolved is not None and resolved.calls:
            self._on_resolved(resolved.calls)
        if resolved.instances:
            log.warning(
                "%s: ended the lease of %d instance(s) %s; %d unresolved call(s) failed (%s)",
                what,
                len(resolved.instances),
                ", ".join(resolved.instances),
                resolved.calls,
                PROXY_RESTART,
            )
        if resolved.lease_lost:
            log.error(
                "instance %s had lost its lease (a heartbeat more than %.1f s late); calls it"
                " had in flight were resolved as %s; it holds a new lease now",
                self.identity.instance_id,
                self.lease_s,
                PROXY_RESTART,
            )

    async def start(self) -> None:
        """Register (or, with the store away, keep trying at every beat) and start beating."""
        self._registered = await self._try(lambda db: register(db, self.identity, self.lease_s))
        self._task = asyncio.create_task(self._beat(), name="capture-instance-lease")

    async def _try(self, apply: Callable[[Db], Resolved]) -> bool:
        try:
            resolved = await self.writer.lease_op(apply)
        except CaptureProxyError as exc:  # the store is away: try again at the next beat
            log.warning("instance lease: the store did not answer: %s", exc.message)
            return False
        what = "heartbeat" if self._registered else f"instance {self.identity.name} started"
        self._note(what, resolved)
        return True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._registered:
                await self._try(lambda db: heartbeat(db, self.identity, self.lease_s))
            else:
                self._registered = await self._try(
                    lambda db: register(db, self.identity, self.lease_s)
                )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            failed = await self.writer.lease_op(lambda db: retire(db, self.identity))
        except CaptureProxyError as exc:
            log.warning("could not retire instance %s: %s", self.identity.instance_id, exc)
            return
        if failed:
            log.warning("stopped with %d unresolved call(s): failed (%s)", failed, PROXY_RESTART)
