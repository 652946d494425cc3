"""Health, readiness and metrics in-process (``ASGITransport``; the fake engine or a dead one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from capture_contracts.bundle import ContinuationRecord
from capture_proxy.app import create_app
from capture_proxy.metrics import FAST_BUCKETS, Histogram, Metrics
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from tests.fixtures import fake_engine
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import metric_samples


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def _client(store_url: str, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    settings = Settings(
        store=StoreSettings(url=store_url),
        upstream=UpstreamSettings(url="http://engine"),
        continuation="passthrough",
    )
    app = create_app(settings, upstream_transport=transport, migrate=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy")
    client.app = app  # type: ignore[attr-defined]
    return client


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    http = await _client(sqlite_url(tmp_path / "capture.db"), fake_engine.transport())
    app = http.app  # type: ignore[attr-defined]
    async with app.router.lifespan_context(app), http:
        yield http


async def test_liveness_and_readiness(client: httpx.AsyncClient) -> None:
    for path in ("/healthz", "/health"):
        response = await client.get(path)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "store": "ok", "engine": "ok"}


async def test_not_ready_when_the_engine_is_unreachable(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "capture.db")  # a migrated store
    http = await _client(url, httpx.MockTransport(_unreachable))
    app = http.app  # type: ignore[attr-defined]
    async with app.router.lifespan_context(app), http:
        ready = await http.get("/readyz")
        assert (await http.get("/healthz")).status_code == 200  # the process itself is fine
    assert ready.status_code == 503
    body = ready.json()
    assert body["status"] == "not_ready" and body["store"] == "ok"
    assert "engine unreachable: GET /health" in body["engine"]


async def test_not_ready_when_the_store_has_no_schema(tmp_path: Path) -> None:
    empty = f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"  # never migrated
    http = await _client(empty, fake_engine.transport())
    app = http.app  # type: ignore[attr-defined]
    async with app.router.lifespan_context(app), http:
        ready = await http.get("/readyz")
        metrics = await http.get("/metrics")
    assert ready.status_code == 503
    assert ready.json()["engine"] == "ok" and "store unreachable" in ready.json()["store"]
    # Metrics still answer without the store's gauge.
    assert metrics.status_code == 200 and "capture_episodes{" not in metrics.text


async def test_metrics_histograms_roles_tokens_and_episodes(client: httpx.AsyncClient) -> None:
    episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
    await client.post("/episodes", json={"group_id": "g"})
    url = f"/episodes/{episode}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        body = {"model": "fake", "messages": messages, "stream": stream}
        assert (await client.post(url, json=body, headers={"X-Call-Role": "policy"})).is_success
    title = [{"role": "system", "content": "You are a title generator"}, *messages]
    await client.post(url, json={"model": "fake", "messages": title})
    await client.post(url, json={"model": "fake-error-500", "messages": messages})
    await client.post(f"/episodes/{episode}/close", json={"reward": 1.0})
    calls = (await client.get(f"/episodes/{episode}/calls")).json()
    response = await client.get("/metrics")
    samples = metric_samples(response.text)

    assert samples['capture_calls_total{role="policy",state="admitted"}'] == 3
    assert samples['capture_calls_total{role="policy",state="completed"}'] == 2
    assert samples['capture_calls_total{role="policy",state="failed"}'] == 1
    assert samples['capture_calls_total{role="auxiliary",state="completed"}'] == 1
    completed = [c for c in calls if c["status"] == "completed"]
    prompt = sum(c["prompt_tokens"] for c in completed)
    assert samples['capture_tokens_captured_total{kind="prompt"}'] == prompt
    assert samples['capture_tokens_captured_total{kind="completion"}'] == 4 * len(completed)
    assert samples['capture_episodes{status="closed"}'] == 1
    assert samples['capture_episodes{status="open"}'] == 1
    # Four requests timed (one failed upstream); three completions committed.
    assert samples['capture_upstream_latency_seconds_count{endpoint="chat"}'] == 4
    assert samples['capture_proxy_overhead_seconds_count{endpoint="chat"}'] == 4
    assert samples['capture_upstream_latency_seconds_bucket{endpoint="chat",le="+Inf"}'] == 4
    assert samples["capture_commit_latency_seconds_count"] == 3
    assert samples["capture_commit_latency_seconds_sum"] > 0
    # Every chat request's prompt was planned (none continues a call: all fresh).
    assert samples['capture_continuation_plan_seconds_count{kind="fresh"}'] == 4
    assert 'capture_continuation_plan_seconds_count{kind="stitched"}' not in samples
    assert "# TYPE capture_proxy_overhead_seconds histogram" in response.text


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.lines("h", (("k", "v"),)) == [
        'h_bucket{k="v",le="0.1"} 2',  # le is inclusive: 0.05 and 0.1
        'h_bucket{k="v",le="1"} 3',
        'h_bucket{k="v",le="+Inf"} 4',
        'h_sum{k="v"} 3.65',
        'h_count{k="v"} 4',
    ]


def test_plan_times_are_kept_for_chat_calls_by_kind() -> None:
    metrics = Metrics()
    metrics.planned(ContinuationRecord(stitched=True, mode="stitch"), 0.02)
    metrics.planned(
        ContinuationRecord(stitched=False, mode="stitch", reason="no_previous_call"), 0.001
    )
    metrics.planned(ContinuationRecord(stitched=False, mode="stitch", reason="not_chat"), 0.001)
    metrics.planned(None, 0.001)
    samples = metric_samples(metrics.render())
    assert samples['capture_continuation_plan_seconds_count{kind="stitched"}'] == 1
    assert samples['capture_continuation_plan_seconds_sum{kind="stitched"}'] == 0.02
    assert samples['capture_continuation_plan_seconds_count{kind="fresh"}'] == 1


def test_an_empty_histogram_and_unknown_names() -> None:
    metrics = Metrics()
    assert "capture_commit_latency_seconds_count" not in metrics.render()
    with metrics.commit_timer():
        pass
    text = metrics.render({"open": 2})
    assert f'capture_commit_latency_seconds_bucket{{le="{FAST_BUCKETS[0]:g}"}} 1' in text
    assert 'capture_episodes{status="open"} 2' in text
    with pytest.raises(KeyError):
        metrics.inc("capture_upstream_latency_seconds")
    with pytest.raises(KeyError):
        metrics.observe_seconds("capture_calls_total", 1.0)
