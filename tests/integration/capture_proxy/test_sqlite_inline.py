"""SQLite: what the capture path does at once on the event loop's thread, and what it leaves to
the writer thread (store/sqlite_writer.py, ``SqliteInline``), on a real store file."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from capture_proxy.errors import Conflict, NotFound
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.records import Admission, ContinuationRecord, Generation
from capture_proxy.store.repository import Store
from capture_proxy.store.sqlite_writer import INLINE_READ_ROWS, INLINE_WRITES_PER_CHECKPOINT
from tests.fixtures.db import sqlite_url

GEN = Generation([1, 2, 3], [4], [-0.5], "stop", reply_hash="r")


def _store(make_store: Callable[..., Store], path: Path) -> Store:
    return make_store(sqlite_url(path), identity=InstanceIdentity.new())


def _thread_of(db: object) -> int:
    return threading.get_ident()


async def _eventually(check: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait until ``check()`` holds (the writer thread's work is done), at most ``seconds``."""
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)


async def test_an_idle_writer_leaves_admissions_and_reads_to_the_loop_thread(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    store = _store(make_store, tmp_path / "capture.db")
    writer = store.writer
    here = threading.get_ident()
    ep = (await store.create_episode("inline")).episode_id
    await writer._run(_thread_of)  # the writer thread runs (and has set WAL mode)
    assert await writer._run(_thread_of, synced=False) == here  # at once, on this thread
    assert await writer._run(_thread_of) != here  # a synced commit: the writer thread
    record = ContinuationRecord(stitched=False, mode="stitch", messages=1, prefix_hash="p")
    [call] = await store.admit(ep, Admission("chat", False, 1, "policy", "a", continuation=record))
    assert await store.complete(ep, [call], [GEN])
    [found] = await store.chat_calls_since(ep, "a", 0)  # read at once: the commit is visible
    assert (found.call_id, found.reply_hash) == (call, "r")
    [info] = await store.list_calls(ep)
    assert (info.status, info.admitted_seq, info.completed_seq) == ("completed", 1, 2)
    await store.aclose()
    # The times written by plain SQL are in SQLAlchemy's format for SQLite (naive UTC).
    with sqlite3.connect(tmp_path / "capture.db") as db:
        stamps = db.execute("SELECT admitted_at, completed_at FROM calls").fetchone()
    for stamp in stamps:
        written = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")
        assert abs((datetime.now(UTC).replace(tzinfo=None) - written).total_seconds()) < 60


async def test_a_lone_calls_completion_commits_on_the_loop_thread_and_others_do_not(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """A synced commit is made at once only for a call alone in the process (``alone``); one
    with company, or while the writer thread is busy, goes to the writer thread's batches."""
    path = tmp_path / "capture.db"
    store = _store(make_store, path)
    writer = store.writer
    here = threading.get_ident()
    ep = (await store.create_episode("inline")).episode_id
    await writer._run(_thread_of)  # the writer thread runs (and has set WAL mode)
    assert await writer._run(_thread_of, alone=True) == here
    assert await writer._run(_thread_of, alone=False) != here
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock: no waiting here
    pending = asyncio.create_task(writer._run(_thread_of, alone=True))
    await asyncio.sleep(0.2)
    assert not pending.done()
    other.execute("COMMIT")
    other.close()
    assert await asyncio.wait_for(pending, 30) != here
    [call] = await store.admit(ep, Admission("chat", False, 1, "policy", "a"))
    assert await writer.complete(ep, [call], [GEN], alone=True) == [2]
    [info] = await store.list_calls(ep)
    assert (info.status, info.admitted_seq, info.completed_seq) == ("completed", 1, 2)
    await store.aclose()


async def test_commits_on_the_loop_thread_have_the_writer_thread_checkpoint_the_wal(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """Lone calls commit on the loop's thread, which never checkpoints: every so many of its
    commits the writer thread does, so the WAL stays as small as SQLite's own checkpoints keep
    it (without them, these calls' WAL would hold ~20 MB)."""
    path = tmp_path / "capture.db"
    store = _store(make_store, path)
    ep = (await store.create_episode("inline")).episode_id
    await store.writer._run(_thread_of)
    admission = Admission("chat", False, 1, "policy", "a")
    gen = Generation(list(range(64)), list(range(20)), [-0.5] * 20, "stop")
    calls = 3 * INLINE_WRITES_PER_CHECKPOINT  # two commits each: ~6 checkpoints asked for
    for _ in range(calls):
        ids = await store.admit(ep, admission)
        assert await store.writer.complete(ep, ids, [gen], alone=True)
    sqlite_writer = store.writer._sqlite
    assert sqlite_writer is not None
    await _eventually(lambda: sqlite_writer.checkpoints >= 3)  # (the last may still run)
    assert sqlite_writer.checkpoints >= 3  # (a few commits went to the writer thread)
    wal = path.with_name(path.name + "-wal").stat().st_size
    assert wal < 8 * 2**20, wal
    assert len(await store.list_calls(ep)) == calls
    await store.aclose()


async def test_checkpoints_asked_for_together_leave_the_writer_idle_after_one(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """Requests for a checkpoint queued together are served by one; the writer is then idle
    again (else nothing would ever be done at once on the loop's thread any more)."""
    store = _store(make_store, tmp_path / "capture.db")
    await store.writer._run(_thread_of)
    sqlite_writer = store.writer._sqlite
    assert sqlite_writer is not None
    with sqlite_writer.using:  # the writer thread waits: the requests queue up together
        for _ in range(3):
            sqlite_writer.checkpoint_soon()
        assert not sqlite_writer.idle
    await _eventually(lambda: sqlite_writer.idle)
    assert sqlite_writer.idle and 1 <= sqlite_writer.checkpoints <= 3  # (1 when all coalesced)
    assert await store.writer._run(_thread_of, alone=True) == threading.get_ident()
    await store.aclose()


async def test_a_held_write_lock_sends_the_admission_to_the_writer_thread(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """Another process writing: the admission waits in the writer thread, not on the loop."""
    path = tmp_path / "capture.db"
    store = _store(make_store, path)
    ep = (await store.create_episode("inline")).episode_id
    await store.writer._run(_thread_of)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the write lock, as another proxy process's batch holds it
    admitting = asyncio.create_task(store.admit(ep, Admission("chat", False, 1, "policy", "a")))
    began = time.monotonic()
    await asyncio.sleep(0.3)  # the loop runs meanwhile
    assert time.monotonic() - began < 0.6 and not admitting.done()
    other.execute("COMMIT")
    other.close()
    [call] = await asyncio.wait_for(admitting, 30)
    [info] = await store.list_calls(ep)
    assert (info.call_id, info.status) == (call, "admitted")
    await store.aclose()


async def test_a_read_of_many_rows_is_left_to_the_writer_thread(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    store = _store(make_store, tmp_path / "capture.db")
    ep = (await store.create_episode("inline")).episode_id
    record = ContinuationRecord(stitched=False, mode="stitch", messages=1, prefix_hash="p")
    admission = Admission("chat", False, 1, "policy", "a", continuation=record)
    calls = []
    for _ in range(INLINE_READ_ROWS + 5):
        [call] = await store.admit(ep, admission)
        assert await store.complete(ep, [call], [GEN])
        calls.append(call)
    found = await store.chat_calls_since(ep, "a", 0)
    assert [c.call_id for c in found] == calls  # all of them, in completion order
    assert [c.call_id for c in await store.chat_calls_since(ep, "a", found[-3].completed_seq)] == (
        calls[-2:]
    )
    await store.aclose()


async def test_an_admission_refused_at_once_is_answered_as_by_the_writer(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    store = _store(make_store, tmp_path / "capture.db")
    ep = (await store.create_episode("inline")).episode_id
    await store.writer._run(_thread_of)
    await store.begin_close(ep, 1.0, {})
    with pytest.raises(Conflict):
        await store.admit(ep, Admission("chat", False, 1, "policy", "a"))
    ep2 = (await store.create_episode("inline")).episode_id  # the write lock was let go
    assert await store.admit(ep2, Admission("chat", False, 1, "policy", "a"))
    await store.aclose()


async def test_a_calls_tokens_are_read_at_once_and_a_missing_call_is_not_found(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """A stitched call's read of its base's tokens wakes no writer thread while it idles."""
    store = _store(make_store, tmp_path / "capture.db")
    ep = (await store.create_episode("inline")).episode_id
    [call] = await store.admit(ep, Admission("chat", False, 1, "policy", "a"))
    assert await store.complete(ep, [call], [GEN])
    sqlite_writer = store.writer._sqlite
    assert sqlite_writer is not None
    await _eventually(lambda: sqlite_writer.idle)
    submitted = sqlite_writer.submitted
    assert await store.call_tokens(call) == ([1, 2, 3], [4])
    with pytest.raises(NotFound):
        await store.call_tokens("no-such-call")
    assert sqlite_writer.submitted == submitted  # neither went to the writer thread
    await store.aclose()


async def test_a_read_batched_with_admissions_adds_no_fsync(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """Under FULL, a batch of admissions commits without the fsync (their completions' sync
    covers them); a read queued beside them (a stitched call's base tokens) needs none either."""
    store = _store(make_store, tmp_path / "capture.db")
    ep = (await store.create_episode("inline")).episode_id
    [base] = await store.admit(ep, Admission("chat", False, 1, "policy", "a"))
    assert await store.complete(ep, [base], [GEN])  # a synced commit: FULL
    sqlite_writer = store.writer._sqlite
    assert sqlite_writer is not None and sqlite_writer.synchronous == "FULL"
    assert sqlite_writer._settings["synchronous"] == "FULL"
    sqlite_writer.using.acquire()  # the writer thread is held: what comes next is one batch
    try:
        first = asyncio.create_task(store.writer._run(_thread_of, writes=False))
        await asyncio.sleep(0.2)  # taken by the writer thread, which waits for the connection
        admitting = asyncio.create_task(store.admit(ep, Admission("chat", False, 1, "policy", "b")))
        reading = asyncio.create_task(store.writer._run(_thread_of, writes=False))
        await asyncio.sleep(0.1)
        assert not (first.done() or admitting.done() or reading.done())
    finally:
        sqlite_writer.using.release()
    await asyncio.wait_for(asyncio.gather(first, admitting, reading), 30)
    assert sqlite_writer._settings["synchronous"] == "NORMAL"  # the batch's commit: no fsync
    assert await store.complete(ep, admitting.result(), [GEN])  # synced again
    assert sqlite_writer._settings["synchronous"] == "FULL"
    await store.aclose()
