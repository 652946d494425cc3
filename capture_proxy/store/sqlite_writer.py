"""The SQLite executor of the store's writer: one thread, one ``sqlite3`` connection, plain SQL.

A dedicated thread applies the queued operations (``batches.py``) in batches, with plain SQL (no ORM
unit of work, no thread hop per statement). ``BEGIN IMMEDIATE`` takes the database write lock, so
the episode counters stay exact when several processes share the file. While that thread has nothing
to do, an operation that needs no fsync (an admission; the look for calls another process completed;
a stitched call's read of its base's tokens) is done at once on the caller's thread instead, on the
same connection (:class:`SqliteInline`), if the write lock is free (a read needs no lock): no
wake-up of the writer thread and of the loop (~0.1 ms of CPU per call when calls come one at a
time); under load, operations go to the thread and share its batches. So does a lone call's
completion (``alone``: no other call in flight in the process), with its fsync waited out on the
loop's thread, where nothing else waits (~0.15 ms of CPU a call fewer at c=1). Commits there never
checkpoint the WAL; every ``INLINE_WRITES_PER_CHECKPOINT`` of them, the writer thread is asked to
(``checkpoint_soon``). As every write of the capture path is this connection's, its ``PRAGMA
data_version`` tells whether anything else committed to the file since
(``Writer.changes_elsewhere``): when nothing did, the look for calls completed elsewhere is skipped
(~0.1 ms per call of an agent whose call continues none of its own).

What a commit promises under each ``synchronous`` setting is in ``writer.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import orjson

from capture_proxy.errors import StoreError
from capture_proxy.store.batches import Op, Outcome, Prologue, apply_batch, settle
from capture_proxy.store.operations import Db

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


def commit_synchronous(setting: SqliteSynchronous, batch: Sequence[Op]) -> SqliteSynchronous:
    """The ``synchronous`` a batch of writes commits with: the store's setting, except that
    under FULL a batch with no write that needs its commit on disk — admissions, and the reads
    queued beside them — commits without the fsync. The next synced commit (the admitted
    call's own completion, or any other) syncs the WAL with it, as the WAL is written in order.
    """
    if setting == "FULL" and not any(op.needs_sync for op in batch):
        return "NORMAL"
    return setting


class _Checkpoint:
    """A request for a WAL checkpoint, queued to the writer thread by the loop's commits."""


_CHECKPOINT = _Checkpoint()


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


class SqliteWriter:
    """The writer thread of one SQLite file, and its connection (which ``SqliteInline`` uses
    on the loop's thread while this thread is idle: ``using`` is held by whichever uses it)."""

    def __init__(self, path: str, synchronous: SqliteSynchronous, max_batch: int) -> None:
        self.path = path
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.prologue: Prologue | None = None
        self.queue: queue.SimpleQueue[Op | _Checkpoint | None] = queue.SimpleQueue()
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

    def submit(self, op: Op | _Checkpoint) -> None:
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
            batch: list[Op] = []
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

    def _transaction(self, db: _SqliteDb, batch: list[Op]) -> list[Outcome]:
        connection = db.connection
        writes = any(op.writes for op in batch)
        try:
            if writes:
                self.configure(
                    busy_ms=SQLITE_BUSY_TIMEOUT_MS,
                    synchronous=commit_synchronous(self.synchronous, batch),
                    autocheckpoint=WAL_AUTOCHECKPOINT_PAGES,
                )
            else:
                self.configure(busy_ms=SQLITE_BUSY_TIMEOUT_MS)
            connection.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            outcomes = apply_batch(db, batch, lambda: _SqliteSavepoint(connection), self.prologue)
            connection.execute("COMMIT")
        except Exception as exc:  # SQLite's, or a fault of an operation's own: never the thread's
            _rollback(db)
            if len(batch) > 1:  # nothing of the batch stands: each operation again, alone
                return [self._transaction(db, [op])[0] for op in batch]
            if not isinstance(exc, sqlite3.Error):
                log.error("a store operation failed", exc_info=exc)
            return [Outcome(error=StoreError(f"the store failed: {exc}"))]
        return outcomes

    def _commit(self, batch: list[Op]) -> None:
        with self.using:
            try:
                db = self.db()
            except sqlite3.Error as exc:
                error = StoreError(f"the store failed: {exc}")
                outcomes = [Outcome(error=error) for _ in batch]
            else:
                outcomes = self._transaction(db, batch)
        self.settled += len(batch)  # (before any caller is answered: it may go on at once)
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list[Op], list[Outcome]]] = {}
        for op, outcome in zip(batch, outcomes, strict=True):
            ops, outs = by_loop.setdefault(op.loop, ([], []))
            ops.append(op)
            outs.append(outcome)
        for loop, (ops, outs) in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(settle, ops, outs)

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


class SqliteInline:
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

    def __init__(self, writer: SqliteWriter) -> None:
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

    def write(self, op: Op, prologue: Prologue | None) -> Outcome | None:
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
                outcome: Outcome
                [outcome] = apply_batch(db, [op], lambda: _SqliteSavepoint(db.connection), prologue)
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
