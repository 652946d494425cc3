"""The capture path and episode lifecycle over real HTTP, on SQLite and PostgreSQL.

The engine here is the fake one (tests/fixtures/fake_engine.py): these tests pin down the proxy's
own logic. The same paths against the real vLLM are in test_real_engine.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.fixtures import fake_engine
from tests.fixtures.proxy import ProxyFactory, ProxyServer, hang_up_once_admitted, metric_samples

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
def proxy(store_url: str, proxy_factory: ProxyFactory) -> ProxyServer:
    return proxy_factory(store_url, transport=fake_engine.transport())


async def _episode(client: httpx.AsyncClient, **body: Any) -> str:
    response = await client.post("/episodes", json={"group_id": "g", **body})
    assert response.status_code == 201, response.text
    episode_id: str = response.json()["episode_id"]
    return episode_id


def _assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    return error


async def _bundle(client: httpx.AsyncClient, episode_id: str) -> dict[str, Any]:
    response = await client.get(f"/episodes/{episode_id}/bundle")
    assert response.status_code == 200
    bundle: dict[str, Any] = response.json()
    return bundle


async def test_create_get_list_and_duplicate(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        created = await client.post(
            "/episodes", json={"group_id": "task-1", "episode_id": "ep-a", "metadata": {"k": 1}}
        )
        assert created.status_code == 201
        body = created.json()
        assert body["status"] == "open"
        assert body["base_url"] == f"{proxy.url}/episodes/ep-a/v1"
        _assert_error(
            await client.post("/episodes", json={"group_id": "x", "episode_id": "ep-a"}), 409
        )
        _assert_error(await client.post("/episodes", json={"episode_id": "no-group"}), 400)
        got = (await client.get("/episodes/ep-a")).json()
        assert got["calls"] == {
            "admitted": 0,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
            "in_flight": 0,
        }
        listed = (await client.get("/episodes", params={"group_id": "task-1"})).json()
        assert [e["episode_id"] for e in listed] == ["ep-a"]
        assert (
            await client.get("/episodes", params={"status": "closed", "group_id": "task-1"})
        ).json() == []
        _assert_error(await client.get("/episodes/missing"), 404)


async def test_chat_whole_is_captured_and_scrubbed(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        request = {"model": "fake", "messages": CHAT}
        response = await client.post(
            f"/episodes/{ep}/v1/chat/completions",
            json=request,
            headers={"X-Agent-Id": "worker-1", "X-Parent-Agent-Id": "parent"},
        )
        assert response.status_code == 200, response.text
        call_id = response.headers["x-capture-call-id"]
        answer = response.json()
        assert "prompt_token_ids" not in answer
        assert "token_ids" not in answer["choices"][0]
        assert answer["choices"][0]["logprobs"] is None
        assert answer["usage"]["completion_tokens"] == fake_engine.COMPLETION_LEN
        bundle = await _bundle(client, ep)
        [call] = bundle["calls"]
        upstream_body = {**request, "return_token_ids": True, "logprobs": True}
        ids, logprobs = fake_engine.completion(upstream_body, 0)
        assert call["call_id"] == call_id
        assert call["status"] == "completed"
        assert (call["agent_id"], call["parent_agent_id"], call["role"]) == (
            "worker-1",
            "parent",
            "policy",
        )
        assert call["prompt_token_ids"] == fake_engine.prompt_ids(request)
        assert call["completion_token_ids"] == ids
        assert call["completion_logprobs"] == pytest.approx(logprobs, abs=1e-6)
        assert (call["admitted_seq"], call["completed_seq"]) == (1, 2)


async def test_client_that_asks_for_logprobs_and_ids_keeps_them(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "fake", "messages": CHAT, "logprobs": True, "return_token_ids": True},
            headers={"X-Episode-Id": ep},
        )
        answer = response.json()
        assert answer["prompt_token_ids"]
        assert len(answer["choices"][0]["logprobs"]["content"]) == fake_engine.COMPLETION_LEN


async def test_streaming_chat_passes_chunks_and_records(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        events = []
        async with client.stream(
            "POST",
            f"/episodes/{ep}/v1/chat/completions",
            json={"model": "fake", "messages": CHAT, "stream": True},
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 1 + fake_engine.COMPLETION_LEN
        assert all("prompt_token_ids" not in c for c in chunks)
        assert all("token_ids" not in ch for c in chunks for ch in c["choices"])
        [call] = (await _bundle(client, ep))["calls"]
        assert call["status"] == "completed"
        assert len(call["completion_token_ids"]) == fake_engine.COMPLETION_LEN
        assert call["prompt_token_ids"] == fake_engine.prompt_ids({"messages": CHAT})


async def test_completions_with_token_prompt_and_n2(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        response = await client.post(
            f"/episodes/{ep}/v1/completions",
            json={"model": "fake", "prompt": [5, 6, 7], "n": 2, "max_tokens": 4},
        )
        assert response.status_code == 200, response.text
        request_id = response.headers["x-capture-call-id"]
        assert response.headers["x-capture-call-ids"] == f"{request_id}-0,{request_id}-1"
        calls = (await _bundle(client, ep))["calls"]
        assert [c["call_id"] for c in calls] == [f"{request_id}-0", f"{request_id}-1"]
        assert all(c["prompt_token_ids"] == [5, 6, 7] for c in calls)
        assert calls[0]["completion_token_ids"] != calls[1]["completion_token_ids"]
        assert [c["admitted_seq"] for c in calls] == [1, 2]
        assert [c["completed_seq"] for c in calls] == [3, 4]


async def test_bad_input_gets_openai_errors_and_loses_nothing(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        ok = await client.post(
            f"/episodes/{ep}/v1/chat/completions", json={"model": "fake", "messages": CHAT}
        )
        assert ok.status_code == 200
        url = f"/episodes/{ep}/v1/chat/completions"
        _assert_error(await client.post(url, content=b"{not json"), 400)
        _assert_error(await client.post(url, json=[1, 2]), 400)
        _assert_error(await client.post(url, json={"model": "fake"}), 400)
        _assert_error(await client.post(url, json={"model": "fake", "messages": CHAT, "n": 0}), 400)
        _assert_error(
            await client.post(f"/episodes/{ep}/v1/completions", json={"model": "fake"}), 400
        )
        error = _assert_error(
            await client.post(
                url, json={"model": "fake", "messages": CHAT}, headers={"X-Call-Role": "boss"}
            ),
            400,
        )
        assert error["param"] == "X-Call-Role"
        _assert_error(
            await client.post("/v1/chat/completions", json={"model": "fake", "messages": CHAT}), 400
        )
        _assert_error(
            await client.post(
                "/episodes/nope/v1/chat/completions", json={"model": "fake", "messages": CHAT}
            ),
            404,
        )
        _assert_error(
            await client.patch(f"/episodes/{ep}/calls/nope", json={"mark": "discarded"}), 404
        )
        _assert_error(await client.patch(f"/episodes/{ep}/calls/nope", json={"mark": "maybe"}), 400)
        # upstream faults: same status, OpenAI body, call recorded failed
        _assert_error(
            await client.post(url, json={"model": "fake-error-500", "messages": CHAT}), 500
        )
        _assert_error(
            await client.post(
                url, json={"model": "fake-error-400", "messages": CHAT, "stream": True}
            ),
            400,
        )
        info = (await client.get(f"/episodes/{ep}")).json()["calls"]
        assert info == {"admitted": 3, "completed": 1, "failed": 2, "cancelled": 0, "in_flight": 0}
        calls = (await client.get(f"/episodes/{ep}/calls")).json()
        assert [c["status"] for c in calls] == ["completed", "failed", "failed"]
        assert "fake engine failure" in calls[1]["error"]


async def test_unreachable_upstream_is_502_and_failed(
    store_url: str, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory(store_url, upstream_url="http://127.0.0.1:9")
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        _assert_error(
            await client.post(
                f"/episodes/{ep}/v1/chat/completions", json={"model": "m", "messages": CHAT}
            ),
            502,
        )
        [call] = (await client.get(f"/episodes/{ep}/calls")).json()
        assert call["status"] == "failed"


async def test_broken_stream_reports_error_in_stream_and_fails_call(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        async with client.stream(
            "POST",
            f"/episodes/{ep}/v1/chat/completions",
            json={"model": "fake-broken", "messages": CHAT, "stream": True},
        ) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert "[DONE]" not in lines[-1]
        assert json.loads(lines[-1][6:])["error"]["type"] == "upstream_error"
        [call] = (await client.get(f"/episodes/{ep}/calls")).json()
        assert call["status"] == "failed"


async def _start_slow_stream(client: httpx.AsyncClient, ep: str) -> tuple[Any, httpx.Response]:
    ctx = client.stream(
        "POST",
        f"/episodes/{ep}/v1/chat/completions",
        json={"model": "fake-slow", "messages": CHAT, "stream": True},
    )
    response = await ctx.__aenter__()
    assert response.status_code == 200
    return ctx, response


async def test_close_waits_then_409_then_cancels_outstanding(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        ep = await _episode(client)
        ctx, response = await _start_slow_stream(client, ep)
        call_id = response.headers["x-capture-call-id"]
        closing = await client.post(f"/episodes/{ep}/close", json={"reward": 1.0, "wait_s": 0.1})
        error = _assert_error(closing, 409)
        assert error["outstanding_calls"] == [call_id]
        assert (await client.get(f"/episodes/{ep}")).json()["status"] == "closing"
        late = await client.post(
            f"/episodes/{ep}/v1/chat/completions", json={"model": "fake", "messages": CHAT}
        )
        assert _assert_error(late, 409)["code"] == "episode_not_open"
        _assert_error(await client.post(f"/episodes/{ep}/close", json={"reward": 2.0}), 409)
        closed = await client.post(
            f"/episodes/{ep}/close", json={"reward": 1.0, "wait_s": 0.1, "cancel_outstanding": True}
        )
        assert closed.status_code == 200, closed.text
        assert closed.json()["status"] == "closed"
        assert closed.json()["calls"]["cancelled"] == 1
        rest = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert "[DONE]" not in rest
        await ctx.__aexit__(None, None, None)
        calls = (await client.get(f"/episodes/{ep}/calls")).json()
        assert [(c["status"], c["error"]) for c in calls] == [("cancelled", "cancelled_by_close")]
        again = await client.post(f"/episodes/{ep}/close", json={"reward": 1.0})
        assert again.status_code == 200 and again.json()["status"] == "closed"
        _assert_error(await client.post(f"/episodes/{ep}/close", json={"reward": 0.5}), 409)


async def test_close_waits_for_a_slow_stream_to_finish(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        ep = await _episode(client)
        ctx, response = await _start_slow_stream(client, ep)
        reader = asyncio.create_task(response.aread())
        closed = await client.post(f"/episodes/{ep}/close", json={"reward": 0.0, "wait_s": 10})
        assert closed.status_code == 200, closed.text
        assert closed.json()["calls"]["completed"] == 1
        assert b"[DONE]" in await reader
        await ctx.__aexit__(None, None, None)


async def test_client_disconnect_cancels_the_call(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        ep = await _episode(client)
        ctx, response = await _start_slow_stream(client, ep)
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
        await ctx.__aexit__(None, None, None)  # hang up mid-stream
        for _ in range(100):
            calls = (await client.get(f"/episodes/{ep}/calls")).json()
            if calls[0]["status"] != "admitted":
                break
            await asyncio.sleep(0.05)
        assert (calls[0]["status"], calls[0]["error"]) == ("cancelled", "client_disconnected")


_WAITING: dict[str, tuple[str, dict[str, Any]]] = {  # never answered: no head, no body
    "chat": ("v1/chat/completions", {"messages": CHAT}),
    "chat, stream": ("v1/chat/completions", {"messages": CHAT, "stream": True}),
    "completions": ("v1/completions", {"prompt": "hello"}),
    "messages": ("v1/messages", {"max_tokens": 16, "messages": CHAT}),
    "responses": ("v1/responses", {"input": "hello"}),
}


@pytest.mark.parametrize("route", list(_WAITING))
async def test_a_client_that_leaves_while_the_engine_works_cancels_its_call(
    proxy: ProxyServer, route: str
) -> None:
    path, body = _WAITING[route]
    fake_engine.ABANDONED.clear()
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        ep = await _episode(client)
        payload = json.dumps({"model": "fake-hang", **body}).encode()
        await hang_up_once_admitted(client, proxy.port, ep, f"/episodes/{ep}/{path}", payload)
        for _ in range(100):
            calls = (await client.get(f"/episodes/{ep}/calls")).json()
            if calls[0]["status"] != "admitted":
                break
            await asyncio.sleep(0.02)
        assert [(c["status"], c["error"]) for c in calls] == [("cancelled", "client_disconnected")]
        assert len(fake_engine.ABANDONED) == 1  # the engine's request was cancelled too
        # the proxy goes on serving, and the episode closes with nothing outstanding
        answer = await client.post(
            f"/episodes/{ep}/v1/chat/completions", json={"model": "fake", "messages": CHAT}
        )
        assert answer.status_code == 200, answer.text
        closed = await client.post(f"/episodes/{ep}/close", json={"reward": 1.0})
        assert closed.status_code == 200, closed.text
        assert closed.json()["calls"]["cancelled"] == 1


async def test_marks_by_patch_and_at_close(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        ids = []
        for text in ["a", "b", "c"]:
            r = await client.post(
                f"/episodes/{ep}/v1/chat/completions",
                json={"model": "fake", "messages": [{"role": "user", "content": text}]},
            )
            ids.append(r.headers["x-capture-call-id"])
        patched = await client.patch(
            f"/episodes/{ep}/calls/{ids[0]}", json={"mark": "discarded", "role": "auxiliary"}
        )
        assert patched.status_code == 200 and patched.json()["mark"] == "discarded"
        _assert_error(
            await client.post(
                f"/episodes/{ep}/close",
                json={"reward": 1, "discarded_calls": [ids[1]], "accepted_calls": [ids[1]]},
            ),
            400,
        )
        closed = await client.post(
            f"/episodes/{ep}/close",
            json={"reward": 1, "discarded_calls": [ids[1]], "accepted_calls": [ids[2]]},
        )
        assert closed.status_code == 200
        calls = {c["call_id"]: c for c in (await _bundle(client, ep))["calls"]}
        assert [calls[i]["mark"] for i in ids] == ["discarded", "discarded", "accepted"]
        assert calls[ids[0]]["role"] == "auxiliary"
        _assert_error(
            await client.patch(f"/episodes/{ep}/calls/{ids[0]}", json={"mark": None}), 409
        )


async def test_fifty_concurrent_calls_across_ten_episodes(proxy: ProxyServer) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as client:
        episodes = [await _episode(client) for _ in range(10)]

        async def one(index: int) -> str:
            ep = episodes[index % 10]
            response = await client.post(
                f"/episodes/{ep}/v1/chat/completions",
                json={
                    "model": "fake",
                    "stream": index % 2 == 0,
                    "messages": [{"role": "user", "content": f"call {index}"}],
                },
                headers={"X-Agent-Id": f"agent-{index % 3}"},
            )
            assert response.status_code == 200, response.text
            await response.aread()
            return response.headers["x-capture-call-id"]

        call_ids = await asyncio.gather(*(one(i) for i in range(50)))
        assert len(set(call_ids)) == 50
        seen: set[str] = set()
        for ep in episodes:
            info = (await client.get(f"/episodes/{ep}")).json()["calls"]
            assert info == {
                "admitted": 5,
                "completed": 5,
                "failed": 0,
                "cancelled": 0,
                "in_flight": 0,
            }
            bundle = await _bundle(client, ep)
            seqs = sorted(
                s for c in bundle["calls"] for s in (c["admitted_seq"], c["completed_seq"])
            )
            assert seqs == list(range(1, 11))  # one gap-free episode-wide counter
            seen |= {c["call_id"] for c in bundle["calls"]}
        assert seen == set(call_ids)


async def test_metrics_count_admissions_terminal_states_and_prompt_construction(
    proxy: ProxyServer,
) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        ep = await _episode(client)
        url = f"/episodes/{ep}/v1/chat/completions"
        assert (await client.post(url, json={"model": "fake", "messages": CHAT})).status_code == 200
        await client.post(url, json={"model": "fake-error-500", "messages": CHAT})
        completions = f"/episodes/{ep}/v1/completions"
        await client.post(completions, json={"model": "fake", "prompt": [1, 2], "n": 2})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = metric_samples(response.text)
    assert samples['capture_calls_admitted_total{endpoint="chat"}'] == 2
    assert samples['capture_calls_admitted_total{endpoint="completions"}'] == 2
    assert samples['capture_calls_finished_total{status="completed"}'] == 3
    assert samples['capture_calls_finished_total{status="failed"}'] == 1
    fresh = {
        k: v for k, v in samples.items() if k.startswith('capture_continuation_total{kind="fresh"')
    }
    assert sum(fresh.values()) == 2  # chat calls only; neither extends an earlier answer
    assert fresh['capture_continuation_total{kind="fresh",reason="no_previous_call"}'] == 1
    assert samples["capture_calls_in_flight"] == 0
