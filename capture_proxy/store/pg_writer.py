"""The PostgreSQL executor of the store's writer: an asyncio task on one asyncpg connection.

The task runs the queued operations (``batches.py``) on one connection of its own, with
prepared statements; the operations run in SQLAlchemy's greenlet bridge, so they stay plain
functions. ``UPDATE episodes … RETURNING seq`` locks the episode row, so the counters are exact
across proxy processes. A batch first locks the rows of every episode it touches, in episode-id
order: two processes' batches over the same episodes then queue behind each other instead of
deadlocking (each taking the episodes in its own arrival order, A then B against B then A,
deadlocked within seconds under load and failed whole batches: 500s). A batch of one episode
needs no such lock (its first update takes the row), a batch of reads runs without a transaction
(one statement each), and a batch of one lone call's admission or completion runs as one
statement (``operations.admit_at_once`` / ``complete_at_once``: a data-modifying WITH, atomic by
itself; when it cannot do it, it changes nothing and the transaction's form does): round trips
to the server are most of this executor's cost, ~0.1 ms of CPU each.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from datetime import UTC, datetime
from typing import Any, ClassVar

import orjson
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import await_only, greenlet_spawn

from capture_proxy.errors import CaptureProxyError, StoreError
from capture_proxy.store import operations
from capture_proxy.store.batches import Op, Outcome, Prologue, apply_batch, settle

_SERVER_CLOCK = "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
_PARAM = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")  # a ``:name`` parameter of our SQL
#: The rows a batch will lock, locked up front in one order (PostgreSQL: LockRows above the Sort).
_LOCK_EPISODES = (
    "SELECT episode_id FROM episodes WHERE episode_id = ANY($1::text[])"
    " ORDER BY episode_id FOR UPDATE"
)


class _PgDb:
    """The operations' SQL on the writer's own asyncpg connection (PostgreSQL).

    The operations are plain functions; the executor runs them in a greenlet (SQLAlchemy's
    bridge, the one its asyncio drivers use) so each statement here awaits asyncpg directly:
    a prepared statement per SQL text, ``$n`` parameters, no ORM, no result processing.
    """

    _sql: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {}
    row_locks = True

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    @classmethod
    def _positional(cls, sql: str) -> tuple[str, tuple[str, ...]]:
        known = cls._sql.get(sql)
        if known is None:
            names: list[str] = []

            def number(match: re.Match[str]) -> str:
                if match.group(1) not in names:
                    names.append(match.group(1))
                return f"${names.index(match.group(1)) + 1}"

            known = cls._sql[sql] = (_PARAM.sub(number, sql), tuple(names))
        return known

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        text, names = self._positional(sql)
        found = await_only(self.connection.fetch(text, *[params[n] for n in names]))
        return [tuple(r) for r in found]

    def run(self, sql: str, params: dict[str, Any]) -> int:
        text, names = self._positional(sql)
        status = await_only(self.connection.execute(text, *[params[n] for n in names]))
        return int(status.rsplit(" ", 1)[-1])  # "UPDATE 1", "INSERT 0 1"

    def now(self) -> datetime:
        return datetime.now(UTC)

    def clock(self) -> float:
        # The server's clock: proxies on several hosts agree on leases without synced clocks.
        return float(await_only(self.connection.fetchval(_SERVER_CLOCK)))

    def json(self, value: Any) -> str:
        return orjson.dumps(value).decode()  # asyncpg takes json columns as text

    def loads(self, value: Any) -> Any:
        return orjson.loads(value) if isinstance(value, str | bytes) else value

    def savepoint(self) -> _PgSavepoint:
        return _PgSavepoint(self.connection)


class _PgSavepoint:
    def __init__(self, connection: Any) -> None:
        self.connection = connection
        await_only(connection.execute("SAVEPOINT op"))

    def commit(self) -> None:
        await_only(self.connection.execute("RELEASE SAVEPOINT op"))

    def rollback(self) -> None:
        await_only(self.connection.execute("ROLLBACK TO SAVEPOINT op"))
        await_only(self.connection.execute("RELEASE SAVEPOINT op"))


class PgWriter:
    """The writer task of a PostgreSQL store (one per event loop), on one connection of its own
    taken from the engine's pool (so the engine's connect arguments apply) and kept; a failed
    batch drops it and the next batch takes a fresh one."""

    def __init__(self, engine: AsyncEngine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.prologue: Prologue | None = None
        self.queues: dict[asyncio.AbstractEventLoop, asyncio.Queue[Op | None]] = {}
        self.tasks: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    def submit(self, op: Op) -> None:
        q = self.queues.get(op.loop)
        if q is None:
            q = self.queues[op.loop] = asyncio.Queue()
            self.tasks[op.loop] = op.loop.create_task(self._run(q), name="capture-store-writer")
        q.put_nowait(op)

    async def _run(self, q: asyncio.Queue[Op | None]) -> None:
        held: AsyncConnection | None = None
        try:
            while True:
                first = await q.get()
                if first is None:
                    return
                batch = [first]
                while len(batch) < self.max_batch and not q.empty():
                    op = q.get_nowait()
                    if op is None:
                        q.put_nowait(None)
                        break
                    batch.append(op)
                held, outcomes = await self._transaction(held, batch)
                settle(batch, outcomes)
        finally:
            if held is not None:
                with contextlib.suppress(Exception):
                    await held.close()

    async def _transaction(
        self, held: AsyncConnection | None, batch: list[Op]
    ) -> tuple[AsyncConnection | None, list[Outcome]]:
        """The batch in one transaction (the connection kept, or dropped after a failure)."""
        try:
            if held is None:
                held = await self.engine.connect()
            return held, await self._commit(held, batch)
        except Exception as exc:  # the driver's errors are many; all mean the same here
            if held is not None:  # a fresh connection for what follows
                with contextlib.suppress(Exception):
                    await held.invalidate()
                with contextlib.suppress(Exception):
                    await held.close()
            if len(batch) > 1:  # nothing of the batch stands: each operation again, alone
                outcomes = []
                again: AsyncConnection | None = None
                for op in batch:
                    again, (outcome,) = await self._transaction(again, [op])
                    outcomes.append(outcome)
                return again, outcomes
            return None, [Outcome(error=StoreError(f"the store failed: {exc}"))]

    async def _commit(self, held: AsyncConnection, batch: list[Op]) -> list[Outcome]:
        raw = await held.get_raw_connection()
        connection: Any = raw.driver_connection  # asyncpg's
        db = _PgDb(connection)
        if len(batch) == 1 and batch[0].at_once is not None:  # one statement, atomic by itself
            try:
                value = await greenlet_spawn(batch[0].at_once, db)
            except operations.NotAtOnce:  # it changed nothing: the transaction's form below
                batch[0].at_once = None  # (not the same statement again in it)
            except CaptureProxyError as exc:  # refused before its statement ran (as in a batch)
                return [Outcome(error=exc)]
            else:
                return [Outcome(value)]
        if not any(op.writes for op in batch):  # reads, one statement each: no transaction
            reads: list[Outcome] = await greenlet_spawn(apply_batch, db, batch, db.savepoint, None)
            return reads
        transaction = connection.transaction()
        await transaction.start()
        try:
            episode_ids = sorted({op.episode_id for op in batch if op.episode_id is not None})
            if len(episode_ids) > 1:  # (one episode's row is locked by its first update)
                await connection.execute(_LOCK_EPISODES, episode_ids)
            outcomes: list[Outcome] = await greenlet_spawn(
                apply_batch, db, batch, db.savepoint, self.prologue
            )
        except BaseException:
            await transaction.rollback()
            raise
        await transaction.commit()
        return outcomes

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        q, task = self.queues.pop(loop, None), self.tasks.pop(loop, None)
        if q is not None and task is not None:
            q.put_nowait(None)
            await task
