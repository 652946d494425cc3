"""When the capture path reads the store for an agent's calls completed by another proxy process
(capture_proxy/continuation.py), on SQLite and on PostgreSQL (which has no ``data_version``:
every such look is a round trip to the server).

A call is continued when the request holds its reply, an assistant message. A request without
one — the first call of every context: an agent's, a worker's, the rewrite after a compaction —
continues no call whatever the store holds, so it is planned without a read; a request with one
that continues no call in memory still reads, and finds what another process completed. A second
store on the same database stands for the other process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_proxy.continuation import Continuations, Plan
from capture_proxy.message_chain import chain, tools_hash
from capture_proxy.settings import Settings
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.records import Admission, ContinuationRecord, Generation
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream
from tests.fixtures.db import sqlite_url

GEN = Generation([1, 2, 3], [4], [-0.5], "stop", reply_hash="r")


@dataclass
class _Reads:
    count: int = 0


def _planner(here: Store) -> tuple[Continuations, _Reads]:
    """A passthrough planner on ``here``, and how many looks for calls completed elsewhere
    it has read the store for."""
    settings = Settings(continuation="passthrough")
    reads = _Reads()
    read = here.chat_calls_since

    async def counted(*args: Any) -> Any:
        reads.count += 1
        return await read(*args)

    here.chat_calls_since = counted  # type: ignore[method-assign,assignment]
    return Continuations(settings, here, Upstream(settings.upstream)), reads


async def _completed_by(store: Store, ep: str, messages: list[dict[str, Any]], reply: str) -> str:
    """A call of agent "a" completed through ``store``, its reply recorded as returned."""
    record = ContinuationRecord(
        stitched=False,
        mode="passthrough",
        messages=len(messages),
        prefix_hash=chain(messages)[-1],
        tools_hash=tools_hash({}),
    )
    [call_id] = await store.admit(
        ep, Admission("chat", False, 1, "policy", "a", continuation=record)
    )
    answer = {"role": "assistant", "content": reply}
    gen = Generation([1, 2], [3], [-0.5], "stop", reply_hash=chain([*messages, answer])[-1])
    assert await store.complete(ep, [call_id], [gen])
    return call_id


async def test_only_a_request_holding_a_reply_reads_for_calls_completed_elsewhere(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    here = make_store(store_url, identity=InstanceIdentity.new())
    elsewhere = make_store(store_url, identity=InstanceIdentity.new())
    continuations, reads = _planner(here)
    ep = (await here.create_episode("reads")).episode_id

    task = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task"}]
    other = await _completed_by(elsewhere, ep, task, "done")
    for _ in range(3):  # the agent's first call, and fresh ones: no reply in the request
        plan = await continuations.plan(ep, "chat", "a", {"messages": task})
        assert plan.record is not None and plan.record.base_call_id is None
    assert reads.count == 0
    continued = [*task, {"role": "assistant", "content": "done"}, {"role": "user", "content": "on"}]
    plan = await continuations.plan(ep, "chat", "a", {"messages": continued})
    assert plan.record is not None
    assert reads.count == 1 and plan.record.base_call_id == other  # read, found, continued
    assert plan.record.reason == "passthrough_mode"


async def test_on_sqlite_the_look_reads_only_after_a_commit_elsewhere(
    tmp_path: Path, make_store: Callable[..., Store]
) -> None:
    """A call that holds a reply but continues none of the agent's calls in memory looks for
    calls another process completed; on SQLite the store is read only when something else
    committed since the last look (``PRAGMA data_version``)."""
    url = sqlite_url(tmp_path / "capture.db")
    here = make_store(url, identity=InstanceIdentity.new())
    elsewhere = make_store(url, identity=InstanceIdentity.new())
    continuations, reads = _planner(here)
    ep = (await here.create_episode("inline")).episode_id
    await here.writer._run(lambda db: None)  # the writer thread runs (and has opened the file)

    async def call(messages: list[dict[str, Any]]) -> Plan:
        plan = await continuations.plan(ep, "chat", "a", {"messages": messages})
        ids = await here.admit(
            ep, Admission("chat", False, 1, "policy", "a", continuation=plan.record)
        )
        assert await here.complete(ep, ids, [GEN])
        return plan

    def foreign(text: str) -> list[dict[str, Any]]:  # a reply this proxy never returned
        return [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "elsewhere?"},
            {"role": "user", "content": "go on"},
        ]

    first = (await call([{"role": "user", "content": "one"}])).record
    assert first is not None and first.reason == "no_previous_call" and reads.count == 0
    second = (await call(foreign("two"))).record
    assert second is not None and second.reason == "not_an_extension" and reads.count == 1
    await call(foreign("three"))
    await call(foreign("four"))
    assert reads.count == 1  # nobody else committed since that look: no read
    messages = [{"role": "user", "content": "five"}]
    other = await _completed_by(elsewhere, ep, messages, "done")
    extended = [
        *messages,
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "more"},
    ]
    plan = await continuations.plan(ep, "chat", "a", {"messages": extended})
    assert plan.record is not None
    assert reads.count == 2 and plan.record.base_call_id == other  # read, found, continued
