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

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from capture_proxy.errors import Conflict, NotFound
from capture_proxy.store import leases, operations
from capture_proxy.store.db import make_engine, make_sessionmaker
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.records import Admission, ContinuationRecord, Generation
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


_ROW = (
    "SELECT call_id, request_id, choice_index, endpoint, stream, agent_id, parent_agent_id, role,"
    " status, admitted_seq, completed_seq, finish_reason, model, prompt_token_ids,"
    " completion_token_ids, completion_logprobs, prompt_tokens, completion_tokens,"
    " usage::text, continuation::text, reply_hash, token_prefix, instance_id, weight_version,"
    " constraint_kind, admitted_at IS NOT NULL, completed_at IS NOT NULL"
    " FROM calls WHERE call_id = :c"
)


async def test_a_lone_call_in_one_statement_is_recorded_as_by_the_transaction(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one admission or one completion runs as one statement (no transaction around
    it: one round trip); two calls recorded the two ways hold the same row, field by field —
    the lease checked, the episode's numbers taken, the drift summary (a base call's tokens a
    prefix of the prompt, or not) computed by the server as the operation computes it."""

    engine = make_engine(postgres_url)
    me = InstanceIdentity.new()
    store = Store(make_sessionmaker(engine), identity=me)
    await store.writer.lease_op(lambda db: leases.register(db, me, 15.0))
    writer = store.writer
    ep = (await store.create_episode("g")).episode_id
    record = ContinuationRecord(stitched=False, mode="stitch", messages=2, prefix_hash="p")
    admission = Admission("chat", True, 1, "policy", "a", "parent", "m", record, 3, "json")
    [base] = await store.admit(ep, admission)
    assert await store.complete(ep, [base], [Generation([1, 2], [3], [-0.5], "stop")])
    gen = Generation([1, 2, 3, 9], [4, 5], [-0.25, -1.5], "length", {"total": 6}, "rh")
    other = Generation([7, 2, 3, 9], [4], [-0.25], "stop")
    iid = me.instance_id
    transaction_forms = operations.admit, operations.complete

    def not_by_a_transaction(*args: object) -> None:
        raise AssertionError("a lone call went through the transaction's form")

    seqs, calls = [], []
    for how, g in (("at once", gen), ("transaction", gen), ("at once", other), ("tx", other)):
        if how == "at once":  # through the store, as the capture path: one statement each
            monkeypatch.setattr(operations, "admit", not_by_a_transaction)
            monkeypatch.setattr(operations, "complete", not_by_a_transaction)
            [call] = await store.admit(ep, admission)
            completed = await writer.complete(ep, [call], [g], base)
            monkeypatch.setattr(operations, "admit", transaction_forms[0])
            monkeypatch.setattr(operations, "complete", transaction_forms[1])
        else:
            call = f"call-{len(seqs)}"
            assert await writer._run(
                lambda db, c=call: operations.admit(db, ep, admission, [c], iid)
            ) == [call]
            completed = await writer._run(
                lambda db, c=call, g=g: operations.complete(db, ep, [c], [g], base)
            )
        calls.append(call)
        seqs.append(completed)
    async with engine.connect() as conn:
        rows = [(await conn.execute(text(_ROW), {"c": c})).one() for c in calls]
    assert seqs == [[4], [6], [8], [10]]  # admissions and completions numbered in turn
    for at_once, tx in ((rows[0], rows[1]), (rows[2], rows[3])):
        strip = (0, 1, 9, 10)  # ids and sequence numbers differ; the rest is the same
        assert [v for i, v in enumerate(at_once) if i not in strip] == [
            v for i, v in enumerate(tx) if i not in strip
        ]
    assert (rows[0].token_prefix, rows[2].token_prefix) == (True, False)
    assert rows[0].prompt_token_ids == operations.pack_ids([1, 2, 3, 9])
    await store.aclose()
    await engine.dispose()


async def test_a_lone_admission_under_a_lost_lease_or_into_a_closed_episode(
    postgres_url: str,
) -> None:
    """The one statement admits nothing; the transaction then answers as ever: the lease is
    taken anew (and the call admitted), a closed episode refuses, a missing one is not found."""
    engine = make_engine(postgres_url)
    me = InstanceIdentity.new()
    store = Store(make_sessionmaker(engine), identity=me)
    await store.writer.lease_op(lambda db: leases.register(db, me, 15.0))
    ep = (await store.create_episode("g")).episode_id
    async with engine.begin() as conn:  # another instance's sweep ended this lease
        await conn.execute(
            text("UPDATE instances SET state = 'expired' WHERE instance_id = :i"),
            {"i": me.instance_id},
        )
    [call] = await store.admit(ep, ADMISSION)
    async with engine.connect() as conn:
        state = (
            await conn.execute(
                text("SELECT state FROM instances WHERE instance_id = :i"), {"i": me.instance_id}
            )
        ).scalar_one()
        owner_sql = text("SELECT instance_id FROM calls WHERE call_id = :c")
        owner = (await conn.execute(owner_sql, {"c": call})).scalar_one()
    assert (state, owner) == ("live", me.instance_id)
    await store.begin_close(ep, 1.0, {})
    with pytest.raises(Conflict):
        await store.admit(ep, ADMISSION)
    with pytest.raises(NotFound):  # an id longer than the column's finds no episode (the fuzz)
        await store.admit("0" * 201, ADMISSION)
    await store.aclose()
    await engine.dispose()
