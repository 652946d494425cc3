"""The reconstruction job over a real store (SQLite and PostgreSQL): exactly-once export."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from capture_proxy.reconstruct_job import run_job
from capture_proxy.store.db import make_engine, make_sessionmaker
from capture_proxy.store.exports import ExportQueries
from capture_proxy.store.models import Call
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.repository import Store
from reconstruct import reconstruct_episode
from tests.fixtures.db import sqlite_url

_OPENED: list[Store] = []


@pytest.fixture(autouse=True)
async def _close_stores() -> AsyncIterator[None]:
    """Close each test's stores in its own loop (an engine left to the garbage collector closes
    its aiosqlite connections from a later test, on a loop that is gone: a thread error)."""
    yield
    while _OPENED:
        store = _OPENED.pop()
        await store.aclose()
        await store._sessions.kw["bind"].dispose()  # its engine


async def _store(url: str) -> Store:
    store = Store(make_sessionmaker(make_engine(url)))
    _OPENED.append(store)
    return store


async def _episode(store: Store, group: str, reward: float, turns: int = 3) -> str:
    """A two-agent episode: a parent chain of ``turns`` calls and one worker call."""
    info = await store.create_episode(group)
    ep = info.episode_id
    prompt = [1, 2, 3]
    for turn in range(turns):
        [call] = await store.admit(ep, Admission("chat", False, 1, "policy", "parent"))
        completion = [10 + turn, 11 + turn]
        await store.complete(ep, [call], [Generation(prompt, completion, [-0.5, -0.25], "stop")])
        prompt = [*prompt, *completion, 50 + turn]
    [worker] = await store.admit(ep, Admission("chat", False, 1, "policy", "w1", "parent"))
    await store.complete(ep, [worker], [Generation([7, 8], [9], [-1.0], "stop")])
    assert await store.begin_close(ep, reward, {}) == "closing"
    assert await store.finish_close(ep)
    return ep


def _read_rows(out: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for path in sorted(out.glob("rows-*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


async def test_job_exports_each_closed_episode_once(store_url: str, tmp_path: Path) -> None:
    store = await _store(store_url)
    episodes = [await _episode(store, "job-g", float(r)) for r in range(3)]
    still_open = (await store.create_episode("job-g")).episode_id
    out = tmp_path / "out"

    report = await run_job(store_url, out, show_progress=False)
    assert set(episodes) <= set(report.exported_episodes)
    assert still_open not in report.exported_episodes
    rows = [r for r in _read_rows(out) if r["episode_id"] in episodes]
    expected = []
    for ep in episodes:
        expected += [r.to_dict() for r in reconstruct_episode(await store.bundle(ep)).rows]
    assert len(rows) == len(expected) == 6  # each episode: one parent chain row + one worker row
    by_id = {r["row_id"]: r for r in rows}
    for row in expected:
        got = by_id[row["row_id"]]
        assert got["input_ids"] == row["input_ids"]
        assert got["loss_mask"] == row["loss_mask"]
        assert got["behavior_logprobs"] == pytest.approx(row["behavior_logprobs"])
        # Parquet holds every span field; a row's dict leaves the optional ones out when unset.
        spans = [{k: v for k, v in span.items() if v is not None} for span in got["spans"]]
        assert spans == row["spans"]
    report_files = list(out.glob("report-*.json"))
    assert report_files and all(json.loads(p.read_text())["episodes"] for p in report_files)

    again = await run_job(store_url, out, show_progress=False)
    assert again.exported_episodes == [] and again.files == []
    assert (await store.get_episode(episodes[0])).exported


async def test_crash_between_write_and_mark_never_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = sqlite_url(tmp_path / "capture.db")
    store = await _store(url)
    ep = await _episode(store, "crash", 1.0)
    out = tmp_path / "out"

    async def crash(*_args: object, **_kw: object) -> int | None:
        raise RuntimeError("killed between write and mark")

    monkeypatch.setattr(ExportQueries, "record_export", crash)
    with pytest.raises(RuntimeError):
        await run_job(url, out, show_progress=False)
    assert len(list(out.glob("rows-*.parquet"))) == 1  # written, never recorded
    assert not (await store.get_episode(ep)).exported
    monkeypatch.undo()

    report = await run_job(url, out, show_progress=False)
    assert len(report.orphans) == 1
    assert report.exported_episodes == [ep]
    rows = _read_rows(out)
    assert len(rows) == 2 and {r["episode_id"] for r in rows} == {ep}
    assert (out / "orphans" / report.orphans[0]).exists()


async def test_refused_episode_is_skipped_and_reported(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "capture.db")
    store = await _store(url)
    good = await _episode(store, "g", 1.0)
    bad = await _episode(store, "g", 0.0)
    engine = make_engine(url)
    async with engine.begin() as conn:  # an unresolved call in a closed episode (store damage)
        await conn.execute(
            update(Call)
            .where(Call.episode_id == bad, Call.agent_id == "w1")
            .values(status="admitted")
        )
    await engine.dispose()
    report = await run_job(url, tmp_path / "out", show_progress=False)
    assert report.exported_episodes == [good]
    assert bad in report.refused and "unresolved" in report.refused[bad]
    assert {r["episode_id"] for r in _read_rows(tmp_path / "out")} == {good}
    assert not (await store.get_episode(bad)).exported


async def test_cli_export_and_job(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "capture.db")
    ep = await _episode(await _store(url), "cli", 0.5)
    cli = [sys.executable, "-m", "capture_proxy.cli"]
    bundle_path = tmp_path / "b.json"
    subprocess.run(
        [*cli, "export", "--episode", ep, "--db", url, "--out", str(bundle_path)], check=True
    )
    bundle = json.loads(bundle_path.read_text())
    assert bundle["schema"] == "capture-episode/v1" and len(bundle["calls"]) == 4
    missing = subprocess.run(
        [*cli, "export", "--episode", "nope", "--db", url], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "not found" in missing.stderr
    done = subprocess.run(
        [*cli, "reconstruct", "--db", url, "--out", str(tmp_path / "rows")],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(done.stdout)
    assert summary["exported_episodes"] == 1 and summary["rows"] == 2
