"""When the capture path reads the store for an agent's calls completed by another proxy process
(capture_proxy/continuation.py), on SQLite and on PostgreSQL (which has no ``data_version``:
every such look is a round trip to the server).

A call is continued when the request holds its reply, an assistant message. A request without
one — the first call of every context: an agent's, a worker's, the rewrite after a compaction —
continues no call whatever the store holds, so it is planned without a read; a request with one
that continues no call in memory still reads, and finds what another process completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from capture_proxy.continuation import Continuations
from capture_proxy.settings import Settings
from capture_proxy.stitch import chain, tools_hash
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.records import Admission, ContinuationRecord, Generation
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream


async def test_only_a_request_holding_a_reply_reads_for_calls_completed_elsewhere(
    store_url: str, make_store: Callable[..., Store]
) -> None:
    here = make_store(store_url, identity=InstanceIdentity.new())
    elsewhere = make_store(store_url, identity=InstanceIdentity.new())
    settings = Settings(continuation="passthrough")
    continuations = Continuations(settings, here, Upstream(settings.upstream))
    reads = 0
    read = here.chat_calls_since

    async def counted(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        return await read(*args)

    here.chat_calls_since = counted  # type: ignore[method-assign,assignment]
    ep = (await here.create_episode("reads")).episode_id

    async def completed_by(store: Store, messages: list[dict[str, Any]], reply: str) -> str:
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

    task = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task"}]
    other = await completed_by(elsewhere, task, "done")
    for _ in range(3):  # the agent's first call, and fresh ones: no reply in the request
        plan = await continuations.plan(ep, "chat", "a", {"messages": task})
        assert plan.record is not None and plan.record.base_call_id is None
    assert reads == 0
    continued = [*task, {"role": "assistant", "content": "done"}, {"role": "user", "content": "on"}]
    plan = await continuations.plan(ep, "chat", "a", {"messages": continued})
    assert plan.record is not None
    assert reads == 1 and plan.record.base_call_id == other  # read, found, continued
    assert plan.record.reason == "passthrough_mode"
