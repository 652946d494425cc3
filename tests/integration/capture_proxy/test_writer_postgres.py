"""Two proxy processes' writers on one PostgreSQL store never deadlock (found by the load test).

Each writer commits a batch of operations in one transaction, and every admission or completion
locks its episode's row (the episode-wide counter). Taken in each batch's arrival order, a batch
locking A then B and another locking B then A deadlocked; PostgreSQL aborted one and every call
of that batch was answered 500. A batch now locks its episodes' rows first, in episode-id order.
The interleaving is forced here: a third connection holds B while the two batches line up.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from capture_proxy.store.db import make_engine, make_sessionmaker
from capture_proxy.store.records import Admission
from capture_proxy.store.repository import Store

ADMISSION = Admission("chat", False, 1, "policy")
_WAITING = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


async def _until_waiting(conn: AsyncConnection, count: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        waiting = (await conn.execute(text(_WAITING))).scalar_one()
        await conn.rollback()  # the activity view is a snapshot per transaction
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"fewer than {count} transactions wait for a lock"
        await asyncio.sleep(0.02)


async def test_batches_over_the_same_episodes_in_opposite_orders_do_not_deadlock(
    postgres_url: str,
) -> None:
    store_1 = Store(make_sessionmaker(make_engine(postgres_url)))
    store_2 = Store(make_sessionmaker(make_engine(postgres_url)))
    a = (await store_1.create_episode("g")).episode_id
    b = (await store_1.create_episode("g")).episode_id
    watcher, holder = make_engine(postgres_url), make_engine(postgres_url)
    try:
        async with watcher.connect() as watch, holder.connect() as hold:
            await hold.execute(
                text("SELECT 1 FROM episodes WHERE episode_id = :b FOR UPDATE"), {"b": b}
            )
            # One batch of the second writer, B then A: it waits for B.
            second = asyncio.gather(store_2.admit(b, ADMISSION), store_2.admit(a, ADMISSION))
            await _until_waiting(watch, 1)
            # One batch of the first writer, A then B: it waits too (for B, or, ordered, for A).
            first = asyncio.gather(store_1.admit(a, ADMISSION), store_1.admit(b, ADMISSION))
            await _until_waiting(watch, 2)
            await hold.rollback()  # B is free: the second batch goes first
        outcomes = await asyncio.gather(second, first, return_exceptions=True)
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        for episode_id in (a, b):
            calls = await store_1.list_calls(episode_id)
            assert sorted(c.admitted_seq for c in calls) == [1, 2]
    finally:
        for store in (store_1, store_2):
            await store.aclose()
        await watcher.dispose()
        await holder.dispose()


async def test_a_close_marking_a_call_does_not_deadlock_with_its_completion(
    postgres_url: str,
) -> None:
    """A close takes the episode row before it marks calls (the writer's order: episode, then
    calls). Forced: a third connection holds the call row while a close marking that call and a
    completion of it line up behind it."""
    from capture_proxy.store.records import Generation

    store = Store(make_sessionmaker(make_engine(postgres_url)))
    closer = Store(make_sessionmaker(make_engine(postgres_url)))
    ep = (await store.create_episode("g")).episode_id
    [call] = await store.admit(ep, ADMISSION)
    watcher, holder = make_engine(postgres_url), make_engine(postgres_url)
    try:
        async with watcher.connect() as watch, holder.connect() as hold:
            await hold.execute(
                text("SELECT 1 FROM calls WHERE call_id = :c FOR UPDATE"), {"c": call}
            )
            # The close first (without the order fix it would wait for the call, holding no
            # episode), then the completion (the episode taken, waiting for the call behind it).
            close = asyncio.ensure_future(closer.begin_close(ep, 1.0, {call: "accepted"}))
            await _until_waiting(watch, 1)
            completion = asyncio.ensure_future(
                store.writer.complete(ep, [call], [Generation([1], [2], [-0.5], "stop")])
            )
            await _until_waiting(watch, 2)
            await hold.rollback()
        outcomes = await asyncio.gather(completion, close, return_exceptions=True)
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        [info] = await store.list_calls(ep)
        assert (info.status, info.mark) == ("completed", "accepted")
    finally:
        for s in (store, closer):
            await s.aclose()
        await watcher.dispose()
        await holder.dispose()
