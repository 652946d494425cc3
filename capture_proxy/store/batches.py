"""One queued operation of the store's writer, and how a batch of them is applied.

Every admission, completion and failure of a call (and the few reads the capture path needs) is
an :class:`Op` queued to the writer (``writer.py``). An executor — the SQLite writer thread
(``sqlite_writer.py``) or the PostgreSQL writer task (``pg_writer.py``) — takes whatever is
queued, applies it in ONE transaction (:func:`apply_batch`), commits, and only then settles each
operation's future (:func:`settle`). The operations themselves are in ``operations.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from capture_proxy.errors import CaptureProxyError
from capture_proxy.store import operations
from capture_proxy.store.operations import Db, Refused


@dataclass(slots=True)
class Op:
    """An operation queued to the writer: what it applies in a batch's transaction, how it is
    committed, and the future its caller awaits (settled on the caller's loop)."""

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

    @property
    def needs_sync(self) -> bool:
        """Whether its commit must reach the disk: a synced write (a read never needs it)."""
        return self.writes and self.synced


@dataclass(slots=True)
class Outcome:
    """An operation's result, or the error it failed with."""

    value: Any = None
    error: BaseException | None = None


def settle(batch: Sequence[Op], outcomes: Sequence[Outcome]) -> None:
    for op, outcome in zip(batch, outcomes, strict=True):
        if op.future.done():  # the caller went away (cancelled); the change stands or not
            continue
        if outcome.error is not None:
            op.future.set_exception(outcome.error)
        else:
            op.future.set_result(outcome.value)


#: Runs once, first, in a batch that holds a leased operation (``Writer``: the lease check).
Prologue = Callable[[Db], None]


def apply_batch(
    db: Db, batch: Sequence[Op], savepoint: Callable[[], Any], prologue: Prologue | None
) -> list[Outcome]:
    """Apply a batch in the open transaction; an operation that may be refused half-way (a
    completion of several choices) runs in a savepoint, so its refusal leaves nothing behind.

    Every other operation is refused, if at all, before it writes — or after no more than taking
    an episode sequence number, which leaves a harmless gap (``*_seq`` order calls, they do not
    count them) — so it needs no savepoint: two statements (two round trips on PostgreSQL)
    fewer per operation. A failure of the store itself aborts the whole batch; the executor then
    applies each operation alone (its ``_transaction``), so one bad operation fails by itself.
    """
    if prologue is not None and any(op.leased for op in batch):
        prologue(db)
    outcomes = []
    for op in batch:
        nested = savepoint() if op.isolated else None
        try:
            value = at_once_or_apply(op, db)
        except Refused as refused:
            if nested is not None:
                nested.rollback()
            outcomes.append(Outcome(refused.result))
        except CaptureProxyError as exc:
            if nested is not None:
                nested.rollback()
            outcomes.append(Outcome(error=exc))
        else:
            if nested is not None:
                nested.commit()
            outcomes.append(Outcome(value))
    return outcomes


def at_once_or_apply(op: Op, db: Db) -> Any:
    """An operation's one statement where it has one (a round trip fewer on PostgreSQL, in a
    batch too), else — or when that statement could not do it, changing nothing — its form of
    several statements."""
    if op.at_once is not None:
        try:
            return op.at_once(db)
        except operations.NotAtOnce:
            pass
    return op.apply(db)
