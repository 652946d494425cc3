"""Group commit: one writer applies the capture path's changes, many calls per transaction.

Every admission, completion and failure of a call (and the few reads the capture path needs) is
an *operation* queued to the writer. The writer takes whatever is queued (at most ``max_batch``),
applies it in ONE transaction — each operation in its own savepoint, so one that is refused
(episode not open, call no longer admitted) changes nothing and disturbs no other — commits, and
only then settles each operation's future. A response is released when its batch is committed.
A lone call waits for no company: its batch is itself, one transaction; under load batches grow
and the commit's cost per call falls.

- SQLite: a dedicated thread with its own ``sqlite3`` connection and plain SQL (no ORM unit of
  work, no thread hop per statement). ``BEGIN IMMEDIATE`` takes the database write lock, so the
  episode counters stay exact when several processes share the file.
- PostgreSQL: an asyncio task running the same operations through SQLAlchemy Core on one
  connection (``run_sync``); ``UPDATE episodes … RETURNING seq`` locks the episode row, so the
  counters are exact across proxy processes.

Durability — what "committed" promises (``store.sqlite_synchronous``): SQLite in WAL mode with
``FULL`` (the default) syncs the WAL to disk at every commit: a committed call survives a crash of
the process and a loss of power. ``NORMAL`` syncs only at checkpoints: a committed call survives a
crash of the process (the WAL is in the operating system's cache) but the last commits before a
power loss can be lost. PostgreSQL: as the server's ``synchronous_commit`` (``on`` by default:
survives both).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, Protocol

import orjson
from sqlalchemy import JSON, bindparam, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from capture_contracts.vocabulary import FailedStatus
from capture_proxy.errors import CaptureProxyError, Conflict, NotFound, StoreError
from capture_proxy.store.packing import pack_ids, pack_logprobs
from capture_proxy.store.records import Admission, Generation

SqliteSynchronous = Literal["FULL", "NORMAL"]
SQLITE_BUSY_TIMEOUT_MS = 30_000

_NEXT_SEQ = "UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id RETURNING seq"
_NEXT_SEQ_OPEN = (
    "UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id AND status = 'open' "
    "RETURNING seq"
)
_EPISODE_STATUS = "SELECT status FROM episodes WHERE episode_id = :episode_id"
_INSERT_CALL = (
    "INSERT INTO calls (call_id, episode_id, request_id, choice_index, endpoint, stream, agent_id,"
    " parent_agent_id, role, status, admitted_seq, model, prompt_token_ids, completion_token_ids,"
    " completion_logprobs, prompt_tokens, completion_tokens, continuation, admitted_at,"
    " weight_version, constraint_kind) VALUES"
    " (:call_id, :episode_id, :request_id, :choice_index, :endpoint, :stream, :agent_id,"
    " :parent_agent_id, :role, 'admitted', :admitted_seq, :model, :empty, :empty, :empty, 0, 0,"
    " :continuation, :now, :weight_version, :constraint_kind)"
)
_COMPLETE_CALL = (
    "UPDATE calls SET status = 'completed', completed_seq = :seq, finish_reason = :finish_reason,"
    " prompt_token_ids = :prompt, completion_token_ids = :completion,"
    " completion_logprobs = :logprobs, prompt_tokens = :prompt_tokens,"
    " completion_tokens = :completion_tokens, usage = :usage, reply_hash = :reply_hash,"
    " token_prefix = :token_prefix, completed_at = :now"
    " WHERE call_id = :call_id AND status = 'admitted'"
)
_CALL_TOKENS = "SELECT prompt_token_ids, completion_token_ids FROM calls WHERE call_id = :call_id"
_FINISH_CALL = (
    "UPDATE calls SET status = :status, error = :error, completed_at = :now"
    " WHERE call_id = :call_id AND episode_id = :episode_id AND status = 'admitted'"
)
_FINISH_CALL_WITH_PROMPT = (
    "UPDATE calls SET status = :status, error = :error, completed_at = :now,"
    " prompt_token_ids = :prompt, prompt_tokens = :prompt_tokens"
    " WHERE call_id = :call_id AND episode_id = :episode_id AND status = 'admitted'"
)
_CHAT_CALLS_SINCE = (
    "SELECT call_id, completed_seq, role, continuation, reply_hash FROM calls"
    " WHERE episode_id = :episode_id AND status = 'completed' AND endpoint = 'chat'"
    " AND {agent} AND completed_seq > :since ORDER BY completed_seq"
)


class _Db(Protocol):
    """What an operation needs of the open transaction."""

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]: ...

    def run(self, sql: str, params: dict[str, Any]) -> int: ...

    def now(self) -> Any: ...

    def json(self, value: Any) -> Any: ...

    def loads(self, value: Any) -> Any: ...


class _Refused(Exception):
    """An operation changes nothing; its savepoint is rolled back and this is its result."""

    def __init__(self, result: Any) -> None:
        self.result = result


# -- the operations (run inside the batch's transaction, each in a savepoint) -----------------


def _next_seq(db: _Db, episode_id: str, *, need_open: bool) -> int | None:
    rows = db.rows(_NEXT_SEQ_OPEN if need_open else _NEXT_SEQ, {"episode_id": episode_id})
    return int(rows[0][0]) if rows else None


def _admit(db: _Db, episode_id: str, admission: Admission, call_ids: Sequence[str]) -> list[str]:
    continuation = (
        None if admission.continuation is None else db.json(admission.continuation.to_dict())
    )
    now = db.now()
    for index, call_id in enumerate(call_ids):
        seq = _next_seq(db, episode_id, need_open=True)
        if seq is None:
            status = db.rows(_EPISODE_STATUS, {"episode_id": episode_id})
            if not status:
                raise NotFound(f"episode {episode_id!r} not found", param="episode_id")
            raise Conflict(
                f"episode {episode_id!r} is {status[0][0]}; it admits no calls",
                code="episode_not_open",
            )
        db.run(
            _INSERT_CALL,
            {
                "call_id": call_id,
                "episode_id": episode_id,
                "request_id": call_ids[0] if len(call_ids) == 1 else call_id.rsplit("-", 1)[0],
                "choice_index": index,
                "endpoint": admission.endpoint,
                "stream": admission.stream,
                "agent_id": admission.agent_id,
                "parent_agent_id": admission.parent_agent_id,
                "role": admission.role,
                "admitted_seq": seq,
                "model": admission.model,
                "empty": b"",
                "continuation": continuation,
                "now": now,
                "weight_version": admission.weight_version,
                "constraint_kind": admission.constraint,
            },
        )
    return list(call_ids)


def _complete(
    db: _Db,
    episode_id: str,
    call_ids: Sequence[str],
    generations: Sequence[Generation],
    base_call_id: str | None,
) -> list[int]:
    base = None
    if base_call_id is not None:
        found = db.rows(_CALL_TOKENS, {"call_id": base_call_id})
        base = bytes(found[0][0] or b"") + bytes(found[0][1] or b"") if found else None
    now = db.now()
    seqs = []
    for call_id, gen in zip(call_ids, generations, strict=True):
        seq = _next_seq(db, episode_id, need_open=False)
        prompt = pack_ids(gen.prompt_token_ids)
        moved = db.run(
            _COMPLETE_CALL,
            {
                "call_id": call_id,
                "seq": seq,
                "finish_reason": gen.finish_reason,
                "prompt": prompt,
                "completion": pack_ids(gen.completion_token_ids),
                "logprobs": pack_logprobs(gen.completion_logprobs),
                "prompt_tokens": len(gen.prompt_token_ids),
                "completion_tokens": len(gen.completion_token_ids),
                "usage": None if gen.usage is None else db.json(gen.usage),
                "reply_hash": gen.reply_hash,
                "token_prefix": None if base is None else prompt.startswith(base),
                "now": now,
            },
        )
        if moved != 1:  # cancelled by a close meanwhile: record nothing of this request
            raise _Refused(None)
        assert seq is not None
        seqs.append(seq)
    return seqs


def _finish(
    db: _Db,
    episode_id: str,
    call_ids: Sequence[str],
    status: FailedStatus,
    error: str,
    prompt_token_ids: Sequence[int] | None,
) -> int:
    params: dict[str, Any] = {
        "episode_id": episode_id,
        "status": status,
        "error": error[:4000],
        "now": db.now(),
    }
    sql = _FINISH_CALL
    if prompt_token_ids:
        sql = _FINISH_CALL_WITH_PROMPT
        params |= {"prompt": pack_ids(prompt_token_ids), "prompt_tokens": len(prompt_token_ids)}
    return sum(db.run(sql, {**params, "call_id": call_id}) for call_id in call_ids)


def _call_tokens(db: _Db, call_id: str) -> tuple[bytes, bytes]:
    found = db.rows(_CALL_TOKENS, {"call_id": call_id})
    if not found:
        raise NotFound(f"call {call_id!r} not found", param="call_id")
    return bytes(found[0][0] or b""), bytes(found[0][1] or b"")


def _chat_calls_since(
    db: _Db, episode_id: str, agent_id: str | None, since: int
) -> list[tuple[str, int, str, Any, str | None]]:
    agent = "agent_id IS NULL" if agent_id is None else "agent_id = :agent_id"
    rows = db.rows(
        _CHAT_CALLS_SINCE.format(agent=agent),
        {"episode_id": episode_id, "agent_id": agent_id, "since": since},
    )
    return [(r[0], int(r[1]), r[2], db.loads(r[3]), r[4]) for r in rows]


# -- the queue and its two executors ------------------------------------------------------------


@dataclass(slots=True)
class _Op:
    apply: Callable[[_Db], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    writes: bool = True


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


def _apply_batch(db: _Db, batch: Sequence[_Op], savepoint: Callable[[], Any]) -> list[_Outcome]:
    outcomes = []
    for op in batch:
        nested = savepoint()
        try:
            value = op.apply(db)
        except _Refused as refused:
            nested.rollback()
            outcomes.append(_Outcome(refused.result))
        except CaptureProxyError as exc:
            nested.rollback()
            outcomes.append(_Outcome(error=exc))
        else:
            nested.commit()
            outcomes.append(_Outcome(value))
    return outcomes


class _SqliteDb:
    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return self.connection.execute(sql, params).fetchall()

    def run(self, sql: str, params: dict[str, Any]) -> int:
        return self.connection.execute(sql, params).rowcount

    def now(self) -> str:
        # SQLAlchemy's storage format for DateTime on SQLite (naive UTC).
        return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")

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
    """The writer thread of one SQLite file."""

    def __init__(self, path: str, synchronous: SqliteSynchronous, max_batch: int) -> None:
        self.path = path
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, op: _Op) -> None:
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._run, name="capture-store-writer", daemon=True
                    )
                    self.thread.start()
        self.queue.put(op)

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, isolation_level=None
        )
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(f"PRAGMA synchronous={self.synchronous}")
        connection.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        connection.execute("PRAGMA foreign_keys=ON")
        return connection

    def _run(self) -> None:
        connection = self._connect()
        db = _SqliteDb(connection)
        try:
            while True:
                first = self.queue.get()
                if first is None:
                    return
                batch = [first]
                while len(batch) < self.max_batch:
                    try:
                        op = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if op is None:
                        self.queue.put(None)  # stop after this batch
                        break
                    batch.append(op)
                self._commit(connection, db, batch)
        finally:
            connection.close()

    def _commit(self, connection: sqlite3.Connection, db: _SqliteDb, batch: list[_Op]) -> None:
        writes = any(op.writes for op in batch)
        try:
            connection.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            outcomes = _apply_batch(db, batch, lambda: _SqliteSavepoint(connection))
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            error = StoreError(f"the store failed: {exc}")
            outcomes = [_Outcome(error=error) for _ in batch]
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


class _CoreDb:
    """SQLAlchemy Core on the sync face of an async connection (PostgreSQL)."""

    _statements: ClassVar[dict[str, Any]] = {}

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    @classmethod
    def _statement(cls, sql: str) -> Any:
        statement = cls._statements.get(sql)
        if statement is None:
            statement = text(sql)
            for name in ("usage", "continuation"):
                if f":{name}" in sql:
                    statement = statement.bindparams(bindparam(name, type_=JSON))
            cls._statements[sql] = statement
        return statement

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.connection.execute(self._statement(sql), params)]

    def run(self, sql: str, params: dict[str, Any]) -> int:
        result = self.connection.execute(self._statement(sql), params)
        return int(result.rowcount)

    def now(self) -> datetime:
        return datetime.now(UTC)

    def json(self, value: Any) -> Any:
        return value

    def loads(self, value: Any) -> Any:
        return orjson.loads(value) if isinstance(value, str | bytes) else value


class _AsyncWriter:
    """The writer task of a PostgreSQL store (one per event loop)."""

    def __init__(self, engine: AsyncEngine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.queues: dict[asyncio.AbstractEventLoop, asyncio.Queue[_Op | None]] = {}
        self.tasks: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    def submit(self, op: _Op) -> None:
        q = self.queues.get(op.loop)
        if q is None:
            q = self.queues[op.loop] = asyncio.Queue()
            self.tasks[op.loop] = op.loop.create_task(self._run(q), name="capture-store-writer")
        q.put_nowait(op)

    async def _run(self, q: asyncio.Queue[_Op | None]) -> None:
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
            try:
                async with self.engine.begin() as connection:
                    outcomes = await connection.run_sync(self._apply, batch)
            except Exception as exc:  # the driver's errors are many; all mean the same here
                error = StoreError(f"the store failed: {exc}")
                outcomes = [_Outcome(error=error) for _ in batch]
            _settle(batch, outcomes)

    @staticmethod
    def _apply(connection: Connection, batch: list[_Op]) -> list[_Outcome]:
        return _apply_batch(_CoreDb(connection), batch, connection.begin_nested)

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
    ) -> None:
        url = make_url(str(engine.url.render_as_string(hide_password=False)))
        self._sqlite: _SqliteWriter | None = None
        self._async: _AsyncWriter | None = None
        if url.get_backend_name() == "sqlite":
            self._sqlite = _SqliteWriter(url.database or ":memory:", sqlite_synchronous, max_batch)
        else:
            self._async = _AsyncWriter(engine, max_batch)

    async def _run(self, apply: Callable[[_Db], Any], *, writes: bool = True) -> Any:
        loop = asyncio.get_running_loop()
        op = _Op(apply, loop, loop.create_future(), writes)
        if self._sqlite is not None:
            self._sqlite.submit(op)
        else:
            assert self._async is not None
            self._async.submit(op)
        return await op.future

    async def admit(self, episode_id: str, admission: Admission, call_ids: list[str]) -> list[str]:
        result: list[str] = await self._run(lambda db: _admit(db, episode_id, admission, call_ids))
        return result

    async def complete(
        self,
        episode_id: str,
        call_ids: Sequence[str],
        generations: Sequence[Generation],
        base_call_id: str | None = None,
    ) -> list[int] | None:
        """The completion sequence numbers, or None when a call was no longer admitted."""
        if len(call_ids) != len(generations):
            raise StoreError(f"{len(call_ids)} calls but {len(generations)} generations")
        result: list[int] | None = await self._run(
            lambda db: _complete(db, episode_id, call_ids, generations, base_call_id)
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
            lambda db: _finish(db, episode_id, call_ids, status, error, prompt_token_ids)
        )
        return result

    async def call_tokens(self, call_id: str) -> tuple[bytes, bytes]:
        """A call's packed prompt and completion ids."""
        result: tuple[bytes, bytes] = await self._run(
            lambda db: _call_tokens(db, call_id), writes=False
        )
        return result

    async def chat_calls_since(
        self, episode_id: str, agent_id: str | None, since: int
    ) -> list[tuple[str, int, str, Any, str | None]]:
        """The agent's completed chat calls with ``completed_seq > since``, in order."""
        result: list[tuple[str, int, str, Any, str | None]] = await self._run(
            lambda db: _chat_calls_since(db, episode_id, agent_id, since), writes=False
        )
        return result

    async def aclose(self) -> None:
        if self._sqlite is not None:
            thread = self._sqlite.stop()
            if thread is not None:
                await asyncio.to_thread(thread.join)
        elif self._async is not None:
            await self._async.stop()
