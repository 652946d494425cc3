"""Instance leases on both backends: orphans of a dead instance fail (proxy_restart), nothing else.

In-process: two ``Store`` objects with their own identities stand for two proxy processes on one
store (the real processes and ``kill -9`` are in tests/integration/reliability/test_crash.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from capture_contracts.vocabulary import PROXY_RESTART
from capture_proxy.store import leases
from capture_proxy.store.leases import InstanceIdentity, InstanceLease
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.repository import Store
from tests.fixtures.db import fresh_postgres_database, sqlite_url

GEN = Generation([1, 2], [3], [-0.5], "stop")
ADMISSION = Admission("chat", False, 1, "policy")

StoreFactory = Callable[..., Store]


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store of this test's own: any live instance's heartbeat sweeps every expired lease of
    its store, so a proxy of another test on a shared database could sweep this test's."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "capture.db")
        return
    with fresh_postgres_database("capture_leases") as url:
        yield url


@pytest.fixture
async def stores(store_url: str, make_store: Callable[..., Store]) -> AsyncIterator[StoreFactory]:
    def make(identity: InstanceIdentity | None = None, lease_s: float = 15.0) -> Store:
        return make_store(store_url, identity=identity, lease_s=lease_s)

    yield make


async def _statuses(store: Store, episode_id: str) -> dict[str, tuple[str, str | None]]:
    return {c.call_id: (c.status, c.error) for c in await store.list_calls(episode_id)}


async def test_a_new_run_of_the_same_name_fails_the_old_runs_unresolved_calls(
    stores: StoreFactory,
) -> None:
    old = InstanceIdentity.new("host-a:8100")
    store_old = stores(old)
    await store_old.writer.lease_op(lambda db: leases.register(db, old, 15.0))
    ep = (await store_old.create_episode("g")).episode_id
    [done] = await store_old.admit(ep, ADMISSION)
    assert await store_old.complete(ep, [done], [GEN])
    [orphan] = await store_old.admit(ep, ADMISSION)
    bystander = InstanceIdentity.new("host-b:8100")
    store_b = stores(bystander)
    await store_b.writer.lease_op(lambda db: leases.register(db, bystander, 15.0))
    [other] = await store_b.admit(ep, ADMISSION)
    tokens_before = await store_old.writer.call_tokens(done)

    new = InstanceIdentity.new("host-a:8100")  # the restart
    store_new = stores(new)
    resolved = await store_new.writer.lease_op(lambda db: leases.register(db, new, 15.0))

    assert resolved.instances == (old.instance_id,) and resolved.calls == 1
    statuses = await _statuses(store_new, ep)
    assert statuses[orphan] == ("failed", PROXY_RESTART)
    assert statuses[done] == ("completed", None)
    assert statuses[other] == ("admitted", None)  # another live instance's call: untouched
    assert await store_new.writer.call_tokens(done) == tokens_before  # byte for byte
    info = await store_new.get_episode(ep)
    assert (info.calls.admitted, info.calls.in_flight) == (3, 1)
    # The dead run's completion, had it come, is refused: the first terminal state stands.
    assert await store_old.complete(ep, [orphan], [GEN]) is False


async def test_an_expired_lease_is_swept_by_a_live_instance_heartbeat(
    stores: StoreFactory,
) -> None:
    dead = InstanceIdentity.new()
    store_dead = stores(dead, lease_s=2.0)
    await store_dead.writer.lease_op(lambda db: leases.register(db, dead, 2.0))
    ep = (await store_dead.create_episode("g")).episode_id
    [orphan] = await store_dead.admit(ep, ADMISSION)
    live = InstanceIdentity.new()
    store_live = stores(live)
    await store_live.writer.lease_op(lambda db: leases.register(db, live, 15.0))
    [served] = await store_live.admit(ep, ADMISSION)

    early = await store_live.writer.lease_op(lambda db: leases.heartbeat(db, live, 15.0))
    assert early.calls == 0  # the lease still runs
    await asyncio.sleep(2.2)
    swept = await store_live.writer.lease_op(lambda db: leases.heartbeat(db, live, 15.0))

    assert swept.instances == (dead.instance_id,) and swept.calls == 1
    statuses = await _statuses(store_live, ep)
    assert statuses == {orphan: ("failed", PROXY_RESTART), served: ("admitted", None)}
    assert await store_live.complete(ep, [served], [GEN])
    await store_live.begin_close(ep, 1.0, {})
    assert await store_live.finish_close(ep)  # nothing left in flight: the episode closes


async def test_an_instance_that_lost_its_lease_learns_it_and_takes_a_new_one(
    stores: StoreFactory,
) -> None:
    slow = InstanceIdentity.new()
    store_slow = stores(slow, lease_s=15.0)  # the lease its admission takes anew
    await store_slow.writer.lease_op(lambda db: leases.register(db, slow, 0.2))
    ep = (await store_slow.create_episode("g")).episode_id
    [lost] = await store_slow.admit(ep, ADMISSION)
    sweeper = InstanceIdentity.new()
    store_sweeper = stores(sweeper)
    await asyncio.sleep(0.3)
    await store_sweeper.writer.lease_op(lambda db: leases.register(db, sweeper, 15.0))

    # The slow instance admits again: its lease is taken anew in the admission's transaction,
    # so the next sweep leaves this call alone.
    [kept] = await store_slow.admit(ep, ADMISSION)
    again = await store_sweeper.writer.lease_op(lambda db: leases.heartbeat(db, sweeper, 15.0))
    assert again.calls == 0
    beat = await store_slow.writer.lease_op(lambda db: leases.heartbeat(db, slow, 15.0))
    assert beat.lease_lost is False  # renewed by the admission already
    statuses = await _statuses(store_slow, ep)
    assert statuses == {lost: ("failed", PROXY_RESTART), kept: ("admitted", None)}
    assert await store_slow.complete(ep, [lost], [GEN]) is False
    assert await store_slow.complete(ep, [kept], [GEN])


async def test_the_lease_runs_in_the_background_and_retires_on_stop(
    stores: StoreFactory,
) -> None:
    me = InstanceIdentity.new()
    store = stores(me, lease_s=1.5)
    lease = InstanceLease(store.writer, me, 1.5)
    await lease.start()
    ep = (await store.create_episode("g")).episode_id
    [call] = await store.admit(ep, ADMISSION)
    other = InstanceIdentity.new()
    store_other = stores(other)
    await asyncio.sleep(2.0)  # past the lease: only the heartbeats keep it
    await store_other.writer.lease_op(lambda db: leases.register(db, other, 15.0))
    assert (await _statuses(store, ep))[call] == ("admitted", None)
    await lease.stop()
    assert (await _statuses(store, ep))[call] == ("failed", PROXY_RESTART)
