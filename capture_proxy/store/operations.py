"""The capture path's store operations: each runs inside the writer's batch transaction.

An operation is a plain function of a :class:`Db` (the open transaction) that returns its result,
raises :class:`Refused` to change nothing and answer a result, or raises a ``CaptureProxyError``
for its caller. The writer (``writer.py``) runs each in its own savepoint, so a refused operation
never disturbs the others of its batch. Plain SQL, shared by both executors (SQLite's ``sqlite3``
and SQLAlchemy Core on PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from capture_contracts.vocabulary import FailedStatus
from capture_proxy.errors import Conflict, NotFound
from capture_proxy.store.packing import pack_ids, pack_logprobs
from capture_proxy.store.records import Admission, Generation

_NEXT_SEQ = "UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id RETURNING seq"
_NEXT_SEQ_OPEN = (
    "UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id AND status = 'open' "
    "RETURNING seq"
)
_EPISODE_STATUS = "SELECT status FROM episodes WHERE episode_id = :episode_id"
_INSERT_CALL = (
    "INSERT INTO calls (call_id, episode_id, request_id, choice_index, endpoint, stream, agent_id,"
    " parent_agent_id, role, status, admitted_seq, model, prompt_token_ids, completion_token_ids,"
    " completion_logprobs, prompt_tokens, completion_tokens, continuation, instance_id,"
    " admitted_at, weight_version, constraint_kind) VALUES"
    " (:call_id, :episode_id, :request_id, :choice_index, :endpoint, :stream, :agent_id,"
    " :parent_agent_id, :role, 'admitted', :admitted_seq, :model, :empty, :empty, :empty, 0, 0,"
    " :continuation, :instance_id, :now, :weight_version, :constraint_kind)"
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

# PostgreSQL alone (a data-modifying WITH): a lone call's admission or completion in ONE
# statement, atomic by itself, so without a transaction around it — one round trip, not four or
# five. The same changes as ``admit`` / ``complete``, or none (then the transaction does it).
# ``held``: the lease check of ``leases.hold`` (its ``_HOLDS``), as a part of the statement.
_HELD = (
    "held AS (UPDATE instances SET state = 'live' WHERE instance_id = :instance_id"
    " AND state = 'live' RETURNING 1), "
)
#: (The episode's id is inserted from its row: a parameter inserted into a column takes the
#: column's type, length included, and an over-long id would fail the statement, not find nothing.)
_ADMIT_AT_ONCE = (
    "WITH {held}next AS (UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id"
    " AND status = 'open'{if_held} RETURNING episode_id, seq)"
    " INSERT INTO calls (call_id, episode_id, request_id, choice_index, endpoint, stream, agent_id,"
    " parent_agent_id, role, status, admitted_seq, model, prompt_token_ids, completion_token_ids,"
    " completion_logprobs, prompt_tokens, completion_tokens, continuation, instance_id,"
    " admitted_at, weight_version, constraint_kind) SELECT"
    " :call_id, next.episode_id, :call_id, 0, :endpoint, :stream, :agent_id,"
    " :parent_agent_id, :role, 'admitted', next.seq, :model, :empty, :empty, :empty, 0, 0,"
    " :continuation, :instance_id, :now, :weight_version, :constraint_kind FROM next"
    " RETURNING admitted_seq"
)
_BASE_IS_PREFIX = (
    "(SELECT substring(:prompt::bytea from 1 for octet_length(b.prompt_token_ids"
    " || b.completion_token_ids)) = b.prompt_token_ids || b.completion_token_ids"
    " FROM calls b WHERE b.call_id = :base_call_id)"
)
_COMPLETE_AT_ONCE = (
    "WITH next AS (UPDATE episodes SET seq = seq + 1 WHERE episode_id = :episode_id"
    " RETURNING seq)"
    " UPDATE calls SET status = 'completed', completed_seq = next.seq,"
    " finish_reason = :finish_reason, prompt_token_ids = :prompt,"
    " completion_token_ids = :completion, completion_logprobs = :logprobs,"
    " prompt_tokens = :prompt_tokens,"
    " completion_tokens = :completion_tokens, usage = :usage, reply_hash = :reply_hash,"
    " token_prefix = {prefix}, completed_at = :now FROM next"
    " WHERE call_id = :call_id AND status = 'admitted' RETURNING calls.completed_seq"
)


class NotAtOnce(Exception):
    """An operation's one-statement form could not do it (the transaction's form will)."""


class Db(Protocol):
    """What an operation needs of the open transaction."""

    #: Whether rows are locked one by one (PostgreSQL), or the whole store by a writing
    #: transaction (SQLite's ``BEGIN IMMEDIATE``: reading a row is as good as locking it).
    row_locks: bool

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]: ...

    def run(self, sql: str, params: dict[str, Any]) -> int: ...

    def now(self) -> Any:
        """The timestamp to store in a DateTime column."""
        ...

    def clock(self) -> float:
        """Seconds since the epoch by the store's clock (PostgreSQL: the server's)."""
        ...

    def json(self, value: Any) -> Any: ...

    def loads(self, value: Any) -> Any: ...


class Refused(Exception):
    """An operation changes nothing; its savepoint is rolled back and this is its result."""

    def __init__(self, result: Any) -> None:
        self.result = result


def next_seq(db: Db, episode_id: str, *, need_open: bool) -> int | None:
    rows = db.rows(_NEXT_SEQ_OPEN if need_open else _NEXT_SEQ, {"episode_id": episode_id})
    return int(rows[0][0]) if rows else None


def _admitted(db: Db, admission: Admission, instance_id: str | None) -> dict[str, Any]:
    """An admission's values, the same for every choice of its request."""
    continuation = admission.continuation
    return {
        "endpoint": admission.endpoint,
        "stream": admission.stream,
        "agent_id": admission.agent_id,
        "parent_agent_id": admission.parent_agent_id,
        "role": admission.role,
        "model": admission.model,
        "empty": b"",
        "continuation": None if continuation is None else db.json(continuation.to_dict()),
        "instance_id": instance_id,
        "now": db.now(),
        "weight_version": admission.weight_version,
        "constraint_kind": admission.constraint,
    }


def admit(
    db: Db,
    episode_id: str,
    admission: Admission,
    call_ids: Sequence[str],
    instance_id: str | None,
) -> list[str]:
    """Admit a request's calls (one per choice), owned by the proxy instance ``instance_id``."""
    values = _admitted(db, admission, instance_id)
    for index, call_id in enumerate(call_ids):
        seq = next_seq(db, episode_id, need_open=True)
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
            values
            | {
                "call_id": call_id,
                "episode_id": episode_id,
                "request_id": call_ids[0] if len(call_ids) == 1 else call_id.rsplit("-", 1)[0],
                "choice_index": index,
                "admitted_seq": seq,
            },
        )
    return list(call_ids)


def admit_at_once(
    db: Db, episode_id: str, admission: Admission, call_id: str, instance_id: str | None
) -> list[str]:
    """``admit`` of one call in one statement (PostgreSQL); NotAtOnce when it admitted nothing
    (the episode not open or missing, the lease lost: ``admit`` says which, or takes it anew)."""
    leased = instance_id is not None
    sql = _ADMIT_AT_ONCE.format(
        held=_HELD if leased else "", if_held=" AND EXISTS (SELECT 1 FROM held)" if leased else ""
    )
    params = _admitted(db, admission, instance_id) | {"call_id": call_id, "episode_id": episode_id}
    if not db.rows(sql, params):
        raise NotAtOnce
    return [call_id]


def _completed(db: Db, call_id: str, gen: Generation, now: Any) -> dict[str, Any]:
    """A completion's values (``prompt``: the packed prompt ids)."""
    return {
        "call_id": call_id,
        "finish_reason": gen.finish_reason,
        "prompt": pack_ids(gen.prompt_token_ids),
        "completion": pack_ids(gen.completion_token_ids),
        "logprobs": pack_logprobs(gen.completion_logprobs),
        "prompt_tokens": len(gen.prompt_token_ids),
        "completion_tokens": len(gen.completion_token_ids),
        "usage": None if gen.usage is None else db.json(gen.usage),
        "reply_hash": gen.reply_hash,
        "now": now,
    }


def complete_at_once(
    db: Db, episode_id: str, call_id: str, gen: Generation, base_call_id: str | None
) -> list[int] | None:
    """``complete`` of one call in one statement (PostgreSQL)."""
    sql = _COMPLETE_AT_ONCE.format(prefix="NULL" if base_call_id is None else _BASE_IS_PREFIX)
    params = _completed(db, call_id, gen, db.now()) | {"episode_id": episode_id}
    if base_call_id is not None:
        params["base_call_id"] = base_call_id
    rows = db.rows(sql, params)
    # none: the call was resolved meanwhile (its sequence number stays taken: a gap, harmless)
    return [int(rows[0][0])] if rows else None


def complete(
    db: Db,
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
        params = _completed(db, call_id, gen, now)  # (ids it cannot keep: refused before a write)
        seq = next_seq(db, episode_id, need_open=False)
        prefix = None if base is None else params["prompt"].startswith(base)
        moved = db.run(_COMPLETE_CALL, params | {"seq": seq, "token_prefix": prefix})
        if moved != 1:  # resolved meanwhile (a close, a sweep): record nothing of this request
            raise Refused(None)  # (its sequence number stays taken: a gap, harmless)
        assert seq is not None
        seqs.append(seq)
    return seqs


def finish(
    db: Db,
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


def call_tokens(db: Db, call_id: str) -> tuple[bytes, bytes]:
    found = db.rows(_CALL_TOKENS, {"call_id": call_id})
    if not found:
        raise NotFound(f"call {call_id!r} not found", param="call_id")
    return bytes(found[0][0] or b""), bytes(found[0][1] or b"")


def chat_calls_since(
    db: Db, episode_id: str, agent_id: str | None, since: int, limit: int | None = None
) -> list[tuple[str, int, str, Any, str | None]]:
    """The first ``limit`` (all: None) of them."""
    agent = "agent_id IS NULL" if agent_id is None else "agent_id = :agent_id"
    sql = _CHAT_CALLS_SINCE.format(agent=agent) + ("" if limit is None else " LIMIT :limit")
    rows = db.rows(
        sql, {"episode_id": episode_id, "agent_id": agent_id, "since": since, "limit": limit}
    )
    return [(r[0], int(r[1]), r[2], db.loads(r[3]), r[4]) for r in rows]
