"""Group commit: one writer applies the capture path's changes, many calls per transaction.

Every admission, completion and failure of a call (and the few reads the capture path needs) is
an *operation* queued to the writer (``batches.py``). The writer takes whatever is queued (at
most ``max_batch``), applies it in ONE transaction — an operation that is refused (episode not
open, call no longer admitted) changes nothing and disturbs no other (one that could be refused
half-way runs in a savepoint: ``batches.apply_batch``) — commits, and only then settles each
operation's future. A response is released when its batch is committed. A lone call waits for
no company: its batch is itself, one transaction; under load batches grow and the commit's cost
per call falls. The operations themselves are in ``operations.py`` (calls) and ``leases.py``
(instances); a batch holding an admission first checks, in its transaction, that this
instance's lease still holds (``leases.hold``), so no call is admitted under a lease a
concurrent sweep is ending.

The executors, one per kind of store:

- SQLite (``sqlite_writer.py``): a dedicated thread with a ``sqlite3`` connection and plain SQL;
  while it has nothing to do, what needs no wait is done at once on the caller's thread, on the
  same connection.
- PostgreSQL (``pg_writer.py``): an asyncio task on one asyncpg connection of its own; a batch
  locks its episodes' rows in one order, so processes sharing the server never deadlock.

Durability — what "committed" promises (``store.sqlite_synchronous``): SQLite in WAL mode with
``FULL`` (the default) syncs the WAL to disk at every commit that holds a completion, a failure or a
lease change: a completed call survives a crash of the process and a loss of power. A batch of
admissions alone (reads beside them included) commits without the sync — nothing is promised of a
call before its completion, whose sync also covers its admission (the WAL is written and synced in
order); a power loss can lose calls still in flight, never a completed one. ``NORMAL`` syncs only at
checkpoints: a committed call survives a crash of the process (the WAL is in the operating system's
cache) but the last commits before a power loss can be lost. PostgreSQL: as the server's
``synchronous_commit`` (``on`` by default: survives both).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from capture_contracts.vocabulary import FailedStatus
from capture_proxy.errors import StoreError
from capture_proxy.store import leases, operations
from capture_proxy.store.batches import Op
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.operations import Db
from capture_proxy.store.pg_writer import PgWriter
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.sqlite_writer import (
    INLINE_READ_ROWS,
    SqliteInline,
    SqliteSynchronous,
    SqliteWriter,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Writer:
    """The capture path's way to change the store (and to read what it needs on the way)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        sqlite_synchronous: SqliteSynchronous = "FULL",
        max_batch: int = 256,
        identity: InstanceIdentity | None = None,
        lease_s: float = 15.0,
    ) -> None:
        """``identity``: the proxy instance whose admissions these are (store/leases.py); the
        reconstruction job and the CLI, which admit nothing, have none."""
        url = make_url(str(engine.url.render_as_string(hide_password=False)))
        self.identity = identity
        self.lease_s = lease_s
        self._sqlite: SqliteWriter | None = None
        self._inline: SqliteInline | None = None
        self._async: PgWriter | None = None
        executor: SqliteWriter | PgWriter
        if url.get_backend_name() == "sqlite":
            path = url.database or ":memory:"
            executor = self._sqlite = SqliteWriter(path, sqlite_synchronous, max_batch)
            if path != ":memory:":  # (a memory database: the writer thread's alone)
                self._inline = SqliteInline(executor)
        else:
            executor = self._async = PgWriter(engine, max_batch)
        if identity is not None:
            executor.prologue = self._hold_lease

    def _hold_lease(self, db: Db) -> None:
        assert self.identity is not None
        if not leases.hold(db, self.identity, self.lease_s):
            log.error(
                "instance %s admitted a call after its lease was taken; it holds a new lease",
                self.identity.instance_id,
            )

    async def _run(
        self,
        apply: Callable[[Db], Any],
        *,
        writes: bool = True,
        synced: bool = True,
        leased: bool = False,
        isolated: bool = False,
        episode_id: str | None = None,
        at_once: Callable[[Db], Any] | None = None,
        alone: bool = False,
    ) -> Any:
        """Queue an operation; its result once committed. On SQLite, while the writer thread
        has nothing to do, an operation without an fsync — or, when the caller's call is
        ``alone`` in this process, with one — is committed at once on this thread instead."""
        loop = asyncio.get_running_loop()
        op = Op(
            apply, loop, loop.create_future(), writes, synced, leased, isolated, episode_id, at_once
        )
        sqlite = self._sqlite
        if (
            self._inline is not None
            and sqlite is not None
            and sqlite.idle
            and (alone or not synced)
        ):
            # at once when the writer thread has nothing to do (else with its next batch)
            done = self._inline.write(op, sqlite.prologue)
            if done is not None:
                if done.error is not None:
                    raise done.error
                return done.value
        if self._sqlite is not None:
            self._sqlite.submit(op)
        else:
            assert self._async is not None
            self._async.submit(op)
        return await op.future

    async def lease_op(self, apply: Callable[[Db], T]) -> T:
        """Run one of the lease's operations (register, heartbeat, retire) as a write."""
        result: T = await self._run(apply)
        return result

    async def admit(self, episode_id: str, admission: Admission, call_ids: list[str]) -> list[str]:
        instance_id = None if self.identity is None else self.identity.instance_id
        at_once = None
        if len(call_ids) == 1 and self._async is not None:
            [call_id] = call_ids

            def at_once(db: Db) -> list[str]:
                return operations.admit_at_once(db, episode_id, admission, call_id, instance_id)

        result: list[str] = await self._run(
            lambda db: operations.admit(db, episode_id, admission, call_ids, instance_id),
            synced=False,  # nothing is promised of a call until its completion commits
            leased=self.identity is not None,
            episode_id=episode_id,
            at_once=at_once,
        )
        return result

    async def complete(
        self,
        episode_id: str,
        call_ids: Sequence[str],
        generations: Sequence[Generation],
        base_call_id: str | None = None,
        *,
        alone: bool = False,
    ) -> list[int] | None:
        """The completion sequence numbers, or None when a call was no longer admitted.

        ``alone``: no other call of this process is in flight. On SQLite its commit may then be
        made on this thread (the fsync waited out here, where nothing else waits: no hop to the
        writer thread and back, ~0.15 ms of CPU a call when calls come one at a time)."""
        if len(call_ids) != len(generations):
            raise StoreError(f"{len(call_ids)} calls but {len(generations)} generations")
        at_once = None
        if len(call_ids) == 1 and self._async is not None:

            def at_once(db: Db) -> list[int] | None:
                return operations.complete_at_once(
                    db, episode_id, call_ids[0], generations[0], base_call_id
                )

        result: list[int] | None = await self._run(
            lambda db: operations.complete(db, episode_id, call_ids, generations, base_call_id),
            isolated=len(call_ids) > 1,  # all choices are recorded, or none
            episode_id=episode_id,
            at_once=at_once,
            alone=alone,
        )
        return result

    async def finish(
        self,
        episode_id: str,
        call_ids: Sequence[str],
        status: FailedStatus,
        error: str,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> int:
        result: int = await self._run(
            lambda db: operations.finish(db, episode_id, call_ids, status, error, prompt_token_ids),
            episode_id=episode_id,
        )
        return result

    async def call_tokens(self, call_id: str) -> tuple[bytes, bytes]:
        """A call's packed prompt and completion ids (one key read: on SQLite read on this
        thread while the writer's has nothing to do)."""
        if self._inline is not None and self._sqlite is not None and self._sqlite.idle:
            found = self._inline.rows(lambda db, most: [operations.call_tokens(db, call_id)], 1)
            if found is not None:
                return found[0]
        result: tuple[bytes, bytes] = await self._run(
            lambda db: operations.call_tokens(db, call_id), writes=False
        )
        return result

    async def chat_calls_since(
        self, episode_id: str, agent_id: str | None, since: int
    ) -> list[tuple[str, int, str, Any, str | None]]:
        """The agent's completed chat calls with ``completed_seq > since``, in order.

        On SQLite read on this thread when they are few (the usual look for calls another
        process completed since finds none), else by the writer's thread."""
        if self._inline is not None and self._sqlite is not None and self._sqlite.idle:
            found = self._inline.rows(
                lambda db, most: operations.chat_calls_since(db, episode_id, agent_id, since, most),
                INLINE_READ_ROWS,
            )
            if found is not None:
                return found
        result: list[tuple[str, int, str, Any, str | None]] = await self._run(
            lambda db: operations.chat_calls_since(db, episode_id, agent_id, since), writes=False
        )
        return result

    def changes_elsewhere(self) -> int | None:
        """A number that changes whenever something other than this writer commits to the
        store (SQLite: ``PRAGMA data_version``), or None when it is not known at once (the
        writer thread busy; PostgreSQL, which has no such number). Equal numbers: nobody else
        committed in between."""
        if self._inline is None or self._sqlite is None or not self._sqlite.idle:
            return None
        return self._inline.data_version()

    async def aclose(self) -> None:
        if self._sqlite is not None:
            thread = self._sqlite.stop()
            if thread is not None:
                await asyncio.to_thread(thread.join)
            self._sqlite.close()
        elif self._async is not None:
            await self._async.stop()
