"""Crash safety with real processes and real signals (issue 12, part 1).

``kill -9`` of a proxy with a streamed call in flight, on a real SQLite file and on the real
PostgreSQL: the call ends ``failed`` (``proxy_restart``) — at once when the proxy restarts under its
name (host:port), within the lease's bound when another proxy on the store outlives it — never
``completed``, never lost; completed calls stay byte for byte; the episode closes and
reconstructs. The reconstruction job killed between writing Parquet and marking re-runs with no
duplicate and no gap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq

from capture_contracts.vocabulary import PROXY_RESTART
from tests.fixtures.db import sqlite_url
from tests.support import processes
from tests.support.processes import Process

LEASE_S = 1.5
MESSAGES = [{"role": "user", "content": "count the fruit"}]


def _episode(proxy: Process, episode_id: str) -> str:
    created = httpx.post(f"{proxy.url}/episodes", json={"group_id": "g", "episode_id": episode_id})
    assert created.status_code == 201, created.text
    return f"{proxy.url}/episodes/{episode_id}/v1/chat/completions"


def _completed_call(url: str) -> str:
    reply = httpx.post(url, json={"model": "fake", "messages": MESSAGES}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-capture-call-id"]


class _Stream:
    """A streamed call held open after its first bytes (admitted, the engine generating)."""

    def __init__(self, url: str, client: httpx.Client) -> None:
        body = {"model": "fake-slow", "stream": True, "messages": MESSAGES}
        self._cm = client.stream("POST", url, json=body, timeout=30)
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200
        self.call_id = self.response.headers["x-capture-call-id"]
        self._chunks = self.response.iter_raw()
        self.received = next(self._chunks)

    def rest(self) -> tuple[bytes, Exception | None]:
        """What else arrives, and the error that ended it (None: it ended normally)."""
        try:
            for chunk in self._chunks:
                self.received += chunk
        except httpx.HTTPError as exc:
            return self.received, exc
        finally:
            self._cm.__exit__(None, None, None)
        return self.received, None


def _calls(proxy: Process, episode_id: str) -> dict[str, dict[str, object]]:
    calls = httpx.get(f"{proxy.url}/episodes/{episode_id}/calls", timeout=10).json()
    return {c["call_id"]: c for c in calls}


def _bundle_call(proxy: Process, episode_id: str, call_id: str) -> dict[str, object]:
    bundle = httpx.get(f"{proxy.url}/episodes/{episode_id}/bundle", timeout=10).json()
    [record] = [c for c in bundle["calls"] if c["call_id"] == call_id]
    return record  # type: ignore[no-any-return]


def _reconstruct(db_url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "capture_proxy.cli", "reconstruct", "--db", db_url]
    return subprocess.run(
        [*argv, "--out", str(out), *extra], capture_output=True, text=True, timeout=120
    )


def test_kill9_mid_stream_then_restart_fails_the_call_at_once(
    tmp_path: Path, engine: Process
) -> None:
    db = sqlite_url(tmp_path / "capture.db")
    env = {"CAPTURE_PROXY_STORE__LEASE_S": "60"}  # only the restart can resolve it in time
    proxy = processes.proxy(tmp_path, db, engine.url, env=env).start()
    url = _episode(proxy, "ep-crash")
    done = _completed_call(url)
    before = _bundle_call(proxy, "ep-crash", done)
    with httpx.Client() as client:
        stream = _Stream(url, client)
        proxy.kill()
        received, error = stream.rest()
    assert error is not None and b"[DONE]" not in received  # the harness saw the stream break

    proxy.start()  # same host:port, same name: the earlier run's calls are resolved at start
    calls = _calls(proxy, "ep-crash")
    assert calls[stream.call_id]["status"] == "failed"
    assert calls[stream.call_id]["error"] == PROXY_RESTART
    assert calls[done]["status"] == "completed"
    assert _bundle_call(proxy, "ep-crash", done) == before  # tokens and logprobs intact
    closed = httpx.post(f"{proxy.url}/episodes/ep-crash/close", json={"reward": 1.0}, timeout=10)
    assert closed.status_code == 200 and closed.json()["status"] == "closed", closed.text
    proxy.stop()

    job = _reconstruct(db, tmp_path / "rows")
    assert job.returncode == 0, job.stderr
    assert json.loads(job.stdout)["exported_episodes"] == 1
    [report] = (tmp_path / "rows").glob("report-*.json")
    accounting = json.loads(report.read_text())["episodes"]["ep-crash"]
    assert accounting["counts"]["trained"] == 1 and accounting["counts"]["failed"] == 1


def test_two_proxies_on_postgres_one_killed(
    tmp_path: Path, engine: Process, postgres_store: str
) -> None:
    env = {"CAPTURE_PROXY_STORE__LEASE_S": str(LEASE_S)}
    victim = processes.proxy(tmp_path, postgres_store, engine.url, env=env).start()
    survivor = processes.proxy(tmp_path, postgres_store, engine.url, env=env).start()
    try:
        url_victim = _episode(victim, "ep-shared")
        url_survivor = f"{survivor.url}/episodes/ep-shared/v1/chat/completions"
        done = _completed_call(url_victim)
        before = _bundle_call(survivor, "ep-shared", done)
        with httpx.Client() as client:
            orphan = _Stream(url_victim, client)
            served = _Stream(url_survivor, client)
            victim.kill()
            killed_at = time.monotonic()
            orphan_received, orphan_error = orphan.rest()
            served_received, served_error = served.rest()
        # The survivor's own stream is untouched by the other's death.
        assert served_error is None and served_received.rstrip().endswith(b"data: [DONE]")
        assert orphan_error is not None and b"[DONE]" not in orphan_received

        deadline = killed_at + LEASE_S * 4 / 3 + 5.0  # the bound, plus a loaded machine's slack
        while _calls(survivor, "ep-shared")[orphan.call_id]["status"] == "admitted":
            assert time.monotonic() < deadline, "the orphan was not resolved within the bound"
            time.sleep(0.1)
        resolved_after = time.monotonic() - killed_at
        calls = _calls(survivor, "ep-shared")
        assert (calls[orphan.call_id]["status"], calls[orphan.call_id]["error"]) == (
            "failed",
            PROXY_RESTART,
        )
        assert calls[served.call_id]["status"] == "completed"
        assert _bundle_call(survivor, "ep-shared", done) == before
        # Not before the lease could have run out (renewed at most a beat before the kill).
        assert resolved_after >= LEASE_S * 2 / 3 - 0.1
        metrics = httpx.get(f"{survivor.url}/metrics", timeout=10).text
        assert "capture_orphans_resolved_total 1" in metrics.splitlines()
        info = httpx.get(f"{survivor.url}/episodes/ep-shared", timeout=10).json()
        assert info["calls"]["admitted"] == 3 and info["calls"]["in_flight"] == 0
        closed = httpx.post(
            f"{survivor.url}/episodes/ep-shared/close", json={"reward": 0.5}, timeout=10
        )
        assert closed.json()["status"] == "closed", closed.text
    finally:
        victim.kill()
        survivor.stop()


_PAUSED_JOB = """
import sys, time
from pathlib import Path
from capture_proxy.store.exports import ExportQueries
from capture_proxy.reconstruct_job import main

async def record_export(self, path, rows, episode_ids):
    Path(sys.argv[1]).write_text(path)  # the Parquet file is written: now wait to be killed
    time.sleep(3600)

ExportQueries.record_export = record_export
sys.exit(main(sys.argv[2:]))
"""


def test_reconstruction_job_killed_between_parquet_and_mark(
    tmp_path: Path, engine: Process
) -> None:
    db = sqlite_url(tmp_path / "capture.db")
    proxy = processes.proxy(tmp_path, db, engine.url).start()
    episodes = [f"ep-job-{i}" for i in range(3)]
    for episode_id in episodes:
        _completed_call(_episode(proxy, episode_id))
        closed = httpx.post(f"{proxy.url}/episodes/{episode_id}/close", json={"reward": 1.0})
        assert closed.json()["status"] == "closed"
    proxy.stop()
    out = tmp_path / "rows"
    marker = tmp_path / "written"
    job = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_JOB, str(marker), "--db", db, "--out", str(out)],
        cwd=processes.REPO,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        job.kill()  # SIGKILL between the Parquet file and its record
        job.wait(timeout=10)
    finally:
        if job.poll() is None:
            job.kill()
    assert len(list(out.glob("rows-*.parquet"))) == 1  # written, never recorded

    rerun = _reconstruct(db, out)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["exported_episodes"] == 3
    assert "orphan" in rerun.stderr
    rows = [r for p in sorted(out.glob("rows-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted(r["episode_id"] for r in rows) == sorted(episodes)  # no duplicate, no gap
    again = _reconstruct(db, out)
    assert json.loads(again.stdout)["exported_episodes"] == 0
