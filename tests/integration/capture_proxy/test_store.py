"""Store-level guarantees on both backends: first terminal state wins, exports claim once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from sqlalchemy import inspect

from capture_proxy.errors import Conflict, NotFound, UpstreamError
from capture_proxy.store.db import make_engine
from capture_proxy.store.packing import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.repository import Store

GEN = Generation([1, 2], [3], [-0.5], "stop")


async def test_schema_comes_from_the_migrations(store_url: str) -> None:
    engine = make_engine(store_url)
    async with engine.connect() as conn:
        tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    await engine.dispose()
    assert {"episodes", "calls", "exports", "alembic_version"} <= tables


async def test_completion_after_cancellation_records_nothing(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    store = make_store(store_url)
    ep = (await store.create_episode("s")).episode_id
    [call] = await store.admit(ep, Admission("chat", False, 1, "policy"))
    assert await store.finish(ep, [call], "cancelled", "cancelled_by_close") == 1
    assert await store.complete(ep, [call], [GEN]) is False
    assert await store.finish(ep, [call], "failed", "late") == 0
    [info] = await store.list_calls(ep)
    assert (info.status, info.error, info.completed_seq) == (
        "cancelled",
        "cancelled_by_close",
        None,
    )


async def test_admission_needs_an_open_episode(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    store = make_store(store_url)
    with pytest.raises(NotFound):
        await store.admit("missing", Admission("chat", False, 1, "policy"))
    ep = (await store.create_episode("s")).episode_id
    await store.begin_close(ep, 1.0, {})
    with pytest.raises(Conflict):
        await store.admit(ep, Admission("chat", False, 1, "policy"))
    assert (await store.get_episode(ep)).calls.admitted == 0


async def test_an_episode_is_claimed_by_one_export_only(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    store = make_store(store_url)
    ep = (await store.create_episode("s")).episode_id
    await store.begin_close(ep, 1.0, {})
    assert await store.finish_close(ep)
    assert await store.exports.record_export("rows-a.parquet", 1, [ep]) is not None
    assert await store.exports.record_export("rows-b.parquet", 1, [ep]) is None
    assert "rows-b.parquet" not in await store.exports.export_paths()


def test_packing_round_trip() -> None:
    ids = [0, 1, 151_000, 2**31 - 1]
    assert unpack_ids(pack_ids(ids)) == ids
    assert len(pack_ids(ids)) == 4 * len(ids)
    assert pack_ids(ids) == np.asarray(ids, dtype="<i4").tobytes()
    assert pack_ids(np.asarray(ids)) == pack_ids(ids) and pack_ids([]) == pack_ids(None) == b""
    for bad in ([3.5], ["7"], [2**31], [None]):  # refused, never converted
        with pytest.raises(UpstreamError, match="not 32-bit integers"):
            pack_ids([1, *bad])
    assert unpack_logprobs(pack_logprobs([-0.5, -1.25])) == [-0.5, -1.25]
    assert unpack_ids(b"") == [] and unpack_logprobs(None) == []


@pytest.mark.parametrize("fault", ["store", "operation"])
async def test_a_store_failure_in_a_batch_fails_only_its_own_operation(
    store_url: str, make_store: Callable[..., Store], fault: str
) -> None:
    """Operations run without savepoints; a store error — or a fault of an operation's own —
    aborts the batch, which is then applied one operation at a time, so only the bad one fails,
    and the writer goes on."""
    import asyncio
    import time

    from capture_proxy.errors import StoreError

    store = make_store(store_url)
    ep = (await store.create_episode("s")).episode_id
    writer = store.writer

    def slow(db: object) -> None:
        time.sleep(0.3)  # the next two queue up meanwhile and share one batch

    def bad(db: object) -> None:
        if fault == "operation":
            raise RuntimeError("boom")
        db.run("INSERT INTO no_such_table (x) VALUES (:x)", {"x": 1})  # type: ignore[attr-defined]

    admission = Admission("chat", False, 1, "policy")
    results = await asyncio.gather(
        writer._run(slow),
        writer._run(bad),
        writer.admit(ep, admission, [f"call-good-{fault}"]),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], StoreError)
    assert results[2] == [f"call-good-{fault}"]
    with pytest.raises(StoreError):  # alone in its batch
        await writer._run(bad)
    assert await writer.admit(ep, admission, [f"call-after-{fault}"]) == [f"call-after-{fault}"]
    calls = await store.list_calls(ep)
    assert [(c.call_id, c.status) for c in calls] == [
        (f"call-good-{fault}", "admitted"),
        (f"call-after-{fault}", "admitted"),
    ]
    await store.aclose()


async def test_token_ids_the_store_cannot_keep_are_the_engines_fault_and_record_nothing(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    """On both stores (PostgreSQL completes a lone call in one statement): an UpstreamError,
    the call still admitted, and the store goes on."""
    store = make_store(store_url)
    ep = (await store.create_episode("s")).episode_id
    admission = Admission("chat", False, 1, "policy", "a")
    [call] = await store.admit(ep, admission)
    for bad in ([3.5], ["7"], [2**31]):
        with pytest.raises(UpstreamError, match="not 32-bit integers"):
            await store.complete(ep, [call], [Generation([1, 2], bad, [-0.1], "stop")])
    with pytest.raises(UpstreamError, match="not 32-bit integers"):
        await store.writer.complete(ep, [call], [Generation([1, 2.5], [3], [-0.1], "stop")])
    [info] = await store.list_calls(ep)
    assert info.status == "admitted"
    assert await store.complete(ep, [call], [Generation([1, 2], [3], [-0.1], "stop")])
    assert await store.call_tokens(call) == ([1, 2], [3])
