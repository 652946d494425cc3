"""Group commit: one writer applies the capture path's changes, many calls per transaction.

Every admission, completion and failure of a call (and the few reads the capture path needs) is
an *operation* queued to the writer. The writer takes whatever is queued (at most ``max_batch``),
applies it in ONE transaction — each operation in its own savepoint, so one that is refused
(episode not open, call no longer admitted) changes nothing and disturbs no other — commits, and
only then settles each operation's future. A response is released when its batch is committed.
A lone call waits for no company: its batch is itself, one transaction; under load batches grow
and the commit's cost per call falls. The operations themselves are in ``operations.py`` (calls)
and ``leases.py`` (instances); a batch holding an admission first checks, in its transaction, that
this instance's lease still holds (``leases.hold``), so no call is admitted under a lease a
concurrent sweep is ending.

- SQLite: a dedicated thread with a ``sqlite3`` connection and plain SQL (no ORM unit of work, no
  thread hop per statement). ``BEGIN IMMEDIATE`` takes the database write lock, so the episode
  counters stay exact when several processes share the file. While that thread has nothing to do, an
  operation that needs no fsync (an admission; the look for calls another process completed) is done
  at once on the caller's thread instead, on the same connection (``_SqliteInline``), if the write
  lock is free: no wake-up of the writer thread and of the loop (~0.1 ms of CPU per call when calls
  come one at a time); under load, operations go to the thread and share its batches. So does a lone
  call's completion (``alone``: no other call in flight in the process), with its fsync waited out
  on the loop's thread, where nothing else waits (~0.15 ms of CPU a call fewer at c=1). Commits
  there never checkpoint the WAL; every ``INLINE_WRITES_PER_CHECKPOINT`` of them, the writer thread
  is asked to (``checkpoint_soon``). As every write of the capture path is this connection's, its
  ``PRAGMA data_version`` tells whether anything else committed to the file since
  (``Writer.changes_elsewhere``): when nothing did, the look for calls completed elsewhere is
  skipped (~0.1 ms per call of an agent whose call continues none of its own).
- PostgreSQL: an asyncio task running the same operations on one asyncpg connection of its own
  (prepared statements; the operations run in SQLAlchemy's greenlet bridge, so they stay plain
  functions); ``UPDATE episodes … RETURNING seq`` locks the episode row, so the counters are
  exact across proxy processes. A batch first locks the rows of every episode it touches, in
  episode-id order: two processes' batches over the same episodes then queue behind each other
  instead of deadlocking (each taking the episodes in its own arrival order, A then B against B
  then A, deadlocked within seconds under load and failed whole batches: 500s). A batch of one
  episode needs no such lock (its first update takes the row), a batch of reads runs without a
  transaction (one statement each), and a batch of one lone call's admission or completion runs
  as one statement (``operations.admit_at_once`` / ``complete_at_once``: a data-modifying WITH,
  atomic by itself; when it cannot do it, it changes nothing and the transaction's form does):
  round trips to the server are most of this executor's cost, ~0.1 ms of CPU each.

Durability — what "committed" promises (``store.sqlite_synchronous``): SQLite in WAL mode with
``FULL`` (the default) syncs the WAL to disk at every commit that holds a completion, a failure
or a lease change: a completed call survives a crash of the process and a loss of power. A batch
of admissions alone commits without the sync — nothing is promised of a call before its
completion, whose sync also covers its admission (the WAL is written and synced in order); a
power loss can lose calls still in flight, never a completed one. ``NORMAL`` syncs only at
checkpoints: a committed call survives a crash of the process (the WAL is in the operating
system's cache) but the last commits before a power loss can be lost. PostgreSQL: as the
server's ``synchronous_commit`` (``on`` by default: survives both).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, TypeVar

import orjson
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import await_only, greenlet_spawn

from capture_contracts.vocabulary import FailedStatus
from capture_proxy.errors import CaptureProxyError, StoreError
from capture_proxy.store import leases, operations
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.operations import Db, Refused
from capture_proxy.store.records import Admission, Generation

log = logging.getLogger(__name__)
T = TypeVar("T")

SqliteSynchronous = Literal["FULL", "NORMAL"]
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: The most rows a read on the event loop's thread returns (more: the writer's thread reads them).
INLINE_READ_ROWS = 32
#: SQLite's default: a commit checkpoints the WAL once it holds this many pages.
WAL_AUTOCHECKPOINT_PAGES = 1000
#: Commits on the loop's thread never checkpoint; after this many of them (~7 pages each for a
#: one-choice call: about ``WAL_AUTOCHECKPOINT_PAGES``) the writer thread is asked to.
INLINE_WRITES_PER_CHECKPOINT = 128
_SERVER_CLOCK = "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
_PARAM = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")  # a ``:name`` parameter of our SQL
#: The rows a batch will lock, locked up front in one order (PostgreSQL: LockRows above the Sort).
_LOCK_EPISODES = (
    "SELECT episode_id FROM episodes WHERE episode_id = ANY($1::text[])"
    " ORDER BY episode_id FOR UPDATE"
)

# -- the queue and its two executors ------------------------------------------------------------


class _Checkpoint:
    """A request for a WAL checkpoint, queued to the writer thread by the loop's commits."""


_CHECKPOINT = _Checkpoint()


@dataclass(slots=True)
class _Op:
    apply: Callable[[Db], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    writes: bool = True
    synced: bool = True  # its commit must reach the disk (FULL): all but admissions
    leased: bool = False  # needs this instance's lease to hold (admissions)
    isolated: bool = False  # may be refused after writing: runs in a savepoint
    episode_id: str | None = None  # the episode whose rows it changes (locked first, in order)
    #: Its one-statement form (PostgreSQL, for a batch of this one operation), or None.
    at_once: Callable[[Db], Any] | None = None


@dataclass(slots=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None


def _settle(batch: Sequence[_Op], outcomes: Sequence[_Outcome]) -> None:
    for op, outcome in zip(batch, outcomes, strict=True):
        if op.future.done():  # the caller went away (cancelled); the change stands or not
            continue
        if outcome.error is not None:
            op.future.set_exception(outcome.error)
        else:
            op.future.set_result(outcome.value)


#: Runs once, first, in a batch that holds a leased operation (``Writer``: the lease check).
Prologue = Callable[[Db], None]


def _apply_batch(
    db: Db, batch: Sequence[_Op], savepoint: Callable[[], Any], prologue: Prologue | None
) -> list[_Outcome]:
    """Apply a batch in the open transaction; an operation that may be refused half-way (a
    completion of several choices) runs in a savepoint, so its refusal leaves nothing behind.

    Every other operation is refused, if at all, before it writes — or after no more than taking
    an episode sequence number, which leaves a harmless gap (``*_seq`` order calls, they do not
    count them) — so it needs no savepoint: two statements (two round trips on PostgreSQL)
    fewer per operation. A failure of the store itself aborts the whole batch; the executor then
    applies each operation alone (``_one_by_one``), so one bad operation fails by itself.
    """
    if prologue is not None and any(op.leased for op in batch):
        prologue(db)
    outcomes = []
    for op in batch:
        nested = savepoint() if op.isolated else None
        try:
            value = _at_once_or_apply(op, db)
        except Refused as refused:
            if nested is not None:
                nested.rollback()
            outcomes.append(_Outcome(refused.result))
        except CaptureProxyError as exc:
            if nested is not None:
                nested.rollback()
            outcomes.append(_Outcome(error=exc))
        else:
            if nested is not None:
                nested.commit()
            outcomes.append(_Outcome(value))
    return outcomes


def _at_once_or_apply(op: _Op, db: Db) -> Any:
    """An operation's one statement where it has one (a round trip fewer on PostgreSQL, in a
    batch too), else — or when that statement could not do it, changing nothing — its form of
    several statements."""
    if op.at_once is not None:
        try:
            return op.at_once(db)
        except operations.NotAtOnce:
            pass
    return op.apply(db)


class _SqliteDb:
    row_locks = False

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return self.connection.execute(sql, params).fetchall()

    def run(self, sql: str, params: dict[str, Any]) -> int:
        return self.connection.execute(sql, params).rowcount

    def now(self) -> str:
        # SQLAlchemy's storage format for DateTime on SQLite (naive UTC: "%Y-%m-%d
        # %H:%M:%S.%f"), written by isoformat in half strftime's time.
        return datetime.now(UTC).isoformat(" ", "microseconds")[:26]

    def clock(self) -> float:
        return time.time()  # one machine's file: its processes share this clock

    def json(self, value: Any) -> str:
        return orjson.dumps(value).decode()

    def loads(self, value: Any) -> Any:
        return None if value is None else orjson.loads(value)


@dataclass(slots=True)
class _SqliteSavepoint:
    connection: sqlite3.Connection
    released: bool = field(default=False)

    def __post_init__(self) -> None:
        self.connection.execute("SAVEPOINT op")

    def commit(self) -> None:
        self.connection.execute("RELEASE op")

    def rollback(self) -> None:
        self.connection.execute("ROLLBACK TO op")
        self.connection.execute("RELEASE op")


class _SqliteWriter:
    """The writer thread of one SQLite file, and its connection (which ``_SqliteInline`` uses
    on the loop's thread while this thread is idle: ``using`` is held by whichever uses it)."""

    def __init__(self, path: str, synchronous: SqliteSynchronous, max_batch: int) -> None:
        self.path = path
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.prologue: Prologue | None = None
        self.queue: queue.SimpleQueue[_Op | _Checkpoint | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.using = threading.Lock()  # the connection is in use (a batch, or an inline op)
        self.connection: sqlite3.Connection | None = None
        self._db: _SqliteDb | None = None
        self.wal = False  # the connection is in WAL mode (inline writes need it)
        #: The connection's settings now (switched only when an operation wants others).
        self._settings: dict[str, int | str] = {}
        self._numbers = itertools.count(1)
        self.submitted = 0  # operations queued so far (numbered on the loops' threads)
        self.settled = 0  # … and answered (counted on the writer's thread)
        self.checkpoints = 0  # checkpoints run on request (``checkpoint_soon``)

    @property
    def idle(self) -> bool:
        """Nothing queued or in a transaction (an operation done at once will not wait)."""
        return self.settled >= self.submitted

    def submit(self, op: _Op | _Checkpoint) -> None:
        self.submitted = next(self._numbers)
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._run, name="capture-store-writer", daemon=True
                    )
                    self.thread.start()
        self.queue.put(op)

    def checkpoint_soon(self) -> None:
        """Have the writer thread checkpoint the WAL (PASSIVE) after what is queued now."""
        self.submit(_CHECKPOINT)

    @property
    def opened(self) -> _SqliteDb | None:
        """The connection if it is open (the writer thread opens it)."""
        return self._db

    def db(self) -> _SqliteDb:
        """The connection (opened on first use, by the writer thread)."""
        if self._db is None:
            connection = sqlite3.connect(
                self.path,
                timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,
                check_same_thread=False,  # the writer thread's, and the loop's while it idles
            )
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self.wal = str(mode).lower() == "wal"
            connection.execute(f"PRAGMA synchronous={self.synchronous}")
            connection.execute("PRAGMA foreign_keys=ON")
            self._settings = {
                "synchronous": self.synchronous,
                "busy_timeout": SQLITE_BUSY_TIMEOUT_MS,
                "wal_autocheckpoint": WAL_AUTOCHECKPOINT_PAGES,
            }
            self.connection = connection
            self._db = _SqliteDb(connection)
        return self._db

    def configure(
        self,
        *,
        busy_ms: int,
        synchronous: str | None = None,
        autocheckpoint: int | None = None,
    ) -> None:
        """Set the connection's pragmas for what comes next (only those that change)."""
        assert self.connection is not None
        for name, value in (
            ("busy_timeout", busy_ms),
            ("synchronous", synchronous),
            ("wal_autocheckpoint", autocheckpoint),
        ):
            if value is not None and self._settings.get(name) != value:
                self.connection.execute(f"PRAGMA {name}={value}")
                self._settings[name] = value

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch: list[_Op] = []
            checkpoints = 0  # requests for one (those queued together: one serves them all)
            while True:
                if isinstance(item, _Checkpoint):
                    checkpoints += 1
                else:
                    batch.append(item)
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)  # stop after this batch
                    break
            if batch:
                self._commit(batch)
            if checkpoints:
                self._checkpoint(checkpoints)

    def _checkpoint(self, requests: int) -> None:
        """A passive checkpoint (it waits for no reader or writer; what it cannot copy now, a
        later one does); failures are logged, as SQLite's own automatic checkpoints ignore them."""
        with self.using:
            try:
                self.db().connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:
                log.warning("a WAL checkpoint failed: %s", exc)
            self.checkpoints += 1
        self.settled += requests

    def _transaction(self, db: _SqliteDb, batch: list[_Op]) -> list[_Outcome]:
        connection = db.connection
        writes = any(op.writes for op in batch)
        # An admission alone commits without an fsync under FULL: the next synced commit (its
        # own completion's, or any other) syncs the WAL with it, as the WAL is written in order.
        wanted = self.synchronous
        if writes and wanted == "FULL" and not any(op.synced for op in batch):
            wanted = "NORMAL"
        if writes:
            self.configure(
                busy_ms=SQLITE_BUSY_TIMEOUT_MS,
                synchronous=wanted,
                autocheckpoint=WAL_AUTOCHECKPOINT_PAGES,
            )
        else:
            self.configure(busy_ms=SQLITE_BUSY_TIMEOUT_MS)
        try:
            connection.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            outcomes = _apply_batch(db, batch, lambda: _SqliteSavepoint(connection), self.prologue)
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if len(batch) > 1:  # nothing of the batch stands: each operation again, alone
                return [self._transaction(db, [op])[0] for op in batch]
            return [_Outcome(error=StoreError(f"the store failed: {exc}"))]
        return outcomes

    def _commit(self, batch: list[_Op]) -> None:
        with self.using:
            try:
                db = self.db()
            except sqlite3.Error as exc:
                error = StoreError(f"the store failed: {exc}")
                outcomes = [_Outcome(error=error) for _ in batch]
            else:
                outcomes = self._transaction(db, batch)
        self.settled += len(batch)  # (before any caller is answered: it may go on at once)
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list[_Op], list[_Outcome]]] = {}
        for op, outcome in zip(batch, outcomes, strict=True):
            ops, outs = by_loop.setdefault(op.loop, ([], []))
            ops.append(op)
            outs.append(outcome)
        for loop, (ops, outs) in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, ops, outs)

    def stop(self) -> threading.Thread | None:
        thread = self.thread
        if thread is not None:
            self.queue.put(None)
        return thread

    def close(self) -> None:
        """Close the connection (after the thread has stopped)."""
        with self.using:
            connection, self.connection, self._db = self.connection, None, None
        if connection is not None:
            with contextlib.suppress(sqlite3.Error):
                connection.close()


class _SqliteInline:
    """What the capture path can do on SQLite at once, on the caller's own thread (the loop's).

    It uses the writer thread's own connection while that thread has nothing to do (its lock
    free): every write of the capture path is then this one connection's, so its
    ``PRAGMA data_version`` changes only when something else commits to the file (what
    ``Writer.changes_elsewhere`` answers). A read needs no write lock and, in WAL mode, never
    waits for a writer; a write that needs no fsync (an admission: ``synced=False``) takes the
    write lock only if it is free (``busy_timeout=0``) and commits without a sync
    (``synchronous=NORMAL``; a later synced commit of the writer thread syncs the WAL, which
    holds it, with its own). Either costs no wake-up of the writer thread and of the loop: two
    thread switches fewer per operation. A lone call's completion is made here too, synced as
    the store's setting says (``Writer.complete(alone=True)``). Whatever cannot be done at
    once — the writer thread busy, the database busy (another process holds the write lock, as
    under load, when operations are better batched anyway), more than a few rows to read, any
    error of SQLite — is left to the writer thread (``None``), which waits for the lock and
    answers store errors as ever. A commit here never checkpoints the WAL
    (``wal_autocheckpoint=0`` while it runs; the writer thread's commits do, and a checkpoint it
    is asked for every ``INLINE_WRITES_PER_CHECKPOINT`` commits made here), so the loop never
    copies the WAL.
    """

    def __init__(self, writer: _SqliteWriter) -> None:
        self.writer = writer
        self.writes = 0  # commits made here (every INLINE_WRITES_PER_CHECKPOINT: a checkpoint)

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[_SqliteDb | None]:
        """The writer's connection if it is open and not in use now, else None (never waits;
        the writer thread opens the connection: opening may wait for the file)."""
        writer = self.writer
        db = writer.opened
        if db is None or not writer.using.acquire(blocking=False):
            yield None
            return
        try:
            yield db
        finally:
            writer.using.release()

    def rows(self, read: Callable[[Db, int], list[T]], most: int) -> list[T] | None:
        """``read(db, most + 1)``'s rows, or None: too many, or not readable at once."""
        with self._borrowed() as db:
            if db is None:
                return None
            try:
                self.writer.configure(busy_ms=0)
                found = read(db, most + 1)
            except sqlite3.Error as exc:
                log.debug("a read was left to the writer thread: %s", exc)
                return None
        return found if len(found) <= most else None

    def data_version(self) -> int | None:
        """SQLite's ``PRAGMA data_version`` on the connection, or None (not known at once).

        It changes when another connection — another proxy process, the job, the CLI —
        commits to the file, never for this connection's own commits: all of the capture
        path's, as this connection is the writer thread's too."""
        with self._borrowed() as db:
            if db is None:
                return None
            try:
                return int(db.connection.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error:
                return None

    def write(self, op: _Op, prologue: Prologue | None) -> _Outcome | None:
        """``op`` in a transaction of its own committed now, or None (left to the writer).

        A synced operation (a lone call's completion) commits with the store's own setting,
        its fsync waited out on this thread; any other without one. Neither checkpoints here:
        every ``INLINE_WRITES_PER_CHECKPOINT`` commits, the writer thread is asked to."""
        synchronous = self.writer.synchronous if op.synced else "NORMAL"
        with self._borrowed() as db:
            if db is None or not self.writer.wal:
                return None
            try:
                self.writer.configure(busy_ms=0, synchronous=synchronous, autocheckpoint=0)
                db.connection.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:  # the write lock is taken: wait for it in the writer thread
                return None
            try:
                outcome: _Outcome
                [outcome] = _apply_batch(
                    db, [op], lambda: _SqliteSavepoint(db.connection), prologue
                )
                db.connection.execute("COMMIT")
            except sqlite3.Error as exc:
                _rollback(db)
                log.debug("a write was left to the writer thread: %s", exc)
                return None
            except BaseException:
                _rollback(db)  # never leave the write lock held
                raise
        self.writes += 1
        if self.writes % INLINE_WRITES_PER_CHECKPOINT == 0:
            self.writer.checkpoint_soon()
        return outcome


def _rollback(db: _SqliteDb) -> None:
    if db.connection.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.connection.execute("ROLLBACK")


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


class _AsyncWriter:
    """The writer task of a PostgreSQL store (one per event loop), on one connection of its own
    taken from the engine's pool (so the engine's connect arguments apply) and kept; a failed
    batch drops it and the next batch takes a fresh one."""

    def __init__(self, engine: AsyncEngine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.prologue: Prologue | None = None
        self.queues: dict[asyncio.AbstractEventLoop, asyncio.Queue[_Op | None]] = {}
        self.tasks: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    def submit(self, op: _Op) -> None:
        q = self.queues.get(op.loop)
        if q is None:
            q = self.queues[op.loop] = asyncio.Queue()
            self.tasks[op.loop] = op.loop.create_task(self._run(q), name="capture-store-writer")
        q.put_nowait(op)

    async def _run(self, q: asyncio.Queue[_Op | None]) -> None:
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
                _settle(batch, outcomes)
        finally:
            if held is not None:
                with contextlib.suppress(Exception):
                    await held.close()

    async def _transaction(
        self, held: AsyncConnection | None, batch: list[_Op]
    ) -> tuple[AsyncConnection | None, list[_Outcome]]:
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
            return None, [_Outcome(error=StoreError(f"the store failed: {exc}"))]

    async def _commit(self, held: AsyncConnection, batch: list[_Op]) -> list[_Outcome]:
        raw = await held.get_raw_connection()
        connection: Any = raw.driver_connection  # asyncpg's
        db = _PgDb(connection)
        if len(batch) == 1 and batch[0].at_once is not None:  # one statement, atomic by itself
            try:
                value = await greenlet_spawn(batch[0].at_once, db)
            except operations.NotAtOnce:  # it changed nothing: the transaction's form below
                batch[0].at_once = None  # (not the same statement again in it)
            else:
                return [_Outcome(value)]
        if not any(op.writes for op in batch):  # reads, one statement each: no transaction
            reads: list[_Outcome] = await greenlet_spawn(
                _apply_batch, db, batch, db.savepoint, None
            )
            return reads
        transaction = connection.transaction()
        await transaction.start()
        try:
            episode_ids = sorted({op.episode_id for op in batch if op.episode_id is not None})
            if len(episode_ids) > 1:  # (one episode's row is locked by its first update)
                await connection.execute(_LOCK_EPISODES, episode_ids)
            outcomes: list[_Outcome] = await greenlet_spawn(
                _apply_batch, db, batch, db.savepoint, self.prologue
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
        self._sqlite: _SqliteWriter | None = None
        self._inline: _SqliteInline | None = None
        self._async: _AsyncWriter | None = None
        executor: _SqliteWriter | _AsyncWriter
        if url.get_backend_name() == "sqlite":
            path = url.database or ":memory:"
            executor = self._sqlite = _SqliteWriter(path, sqlite_synchronous, max_batch)
            if path != ":memory:":  # (a memory database: the writer thread's alone)
                self._inline = _SqliteInline(executor)
        else:
            executor = self._async = _AsyncWriter(engine, max_batch)
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
        op = _Op(
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
        """A call's packed prompt and completion ids."""
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
