"""The store alone: committed calls per second through the group-commit writer (issue 11).

::

    python benchmarks/bench_store.py [--store sqlite,postgres] [--calls 4000] [--concurrency 64]
                                     [--prompt 2048] [--completion 200] [--json]

No HTTP, no engine: ``concurrency`` tasks each admit a call and complete it (``Writer.admit`` then
``Writer.complete``, 2k-token prompts and 200-token completions with logprobs by default) over 64
episodes, as the capture path does, until ``calls`` calls are committed. Per store: committed calls
per second, the time per call of this process's CPU, the batch sizes the writer reached, and the
bytes the store holds per captured token (SQLite: the file and its WAL after a checkpoint;
PostgreSQL: ``pg_total_relation_size`` of ``calls``). The baseline beside each figure is the same
store with ``store.max_batch=1`` (one transaction per operation: no group commit). SQLite runs
with its default durability (``FULL``: an fsync per transaction) and with ``NORMAL``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The store of this script's own checkout, not the installed one: a checkout of another revision
# (``git worktree add /tmp/base <rev>``) measures that revision's store.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capture_proxy.store.db import make_engine, make_sessionmaker, upgrade_async
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.repository import Store

EPISODES = 64


def _generation(rng: random.Random, prompt: int, completion: int) -> Generation:
    return Generation(
        [rng.randrange(4096) for _ in range(prompt)],
        [rng.randrange(4096) for _ in range(completion)],
        [-rng.random() * 5 for _ in range(completion)],
        "stop",
    )


async def _pg_database() -> str:
    import asyncpg

    name = f"bench_store_{os.getpid()}_{random.randrange(10**6)}"
    conn = await asyncpg.connect(host="127.0.0.1", user="postgres", database="test")
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    return name


async def _pg_drop(name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(host="127.0.0.1", user="postgres", database="test")
    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await conn.close()


async def _pg_calls_bytes(name: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(host="127.0.0.1", user="postgres", database=name)
    size = await conn.fetchval("SELECT pg_total_relation_size('calls')")
    await conn.close()
    return int(size)


def _sqlite_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


async def run_case(
    kind: str, synchronous: str, max_batch: int, calls: int, concurrency: int, args: Any
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    pg_name = None
    if kind == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp / 'store.db'}"
    else:
        pg_name = await _pg_database()
        url = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{pg_name}"
    await upgrade_async(url)
    engine = make_engine(url)
    identity = InstanceIdentity.new()
    store = Store(
        make_sessionmaker(engine),
        sqlite_synchronous=synchronous,  # type: ignore[arg-type]
        max_batch=max_batch,
        identity=identity,
    )
    episodes = [(await store.create_episode("bench")).episode_id for _ in range(EPISODES)]
    rng = random.Random(0)
    pool = [_generation(rng, args.prompt, args.completion) for _ in range(16)]
    admission = Admission("chat", False, 1, "policy", "agent")
    done = 0

    async def worker(k: int) -> None:
        nonlocal done
        i = k
        while done < calls:
            episode = episodes[i % EPISODES]
            call_ids = await store.admit(episode, admission)
            await store.writer.complete(episode, call_ids, [pool[i % len(pool)]])
            done += 1
            i += concurrency

    cpu0, began = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu0
    await store.aclose()
    await engine.dispose()
    tokens = done * (args.prompt + args.completion)
    stored = _sqlite_bytes(tmp / "store.db") if kind == "sqlite" else await _pg_calls_bytes(pg_name)
    if pg_name is not None:
        await _pg_drop(pg_name)
    return {
        "store": kind if kind != "sqlite" else f"sqlite {synchronous}",
        "max_batch": max_batch,
        "calls": done,
        "calls_per_s": done / elapsed,
        "cpu_ms_per_call": 1000 * cpu / done,
        "bytes_per_token": stored / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="sqlite,postgres")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = []
    for kind in args.store.split(","):
        for synchronous in ("FULL", "NORMAL") if kind == "sqlite" else ("FULL",):
            for max_batch in (256, 1):  # group commit, then the one-transaction-per-op baseline
                calls = args.calls if max_batch > 1 else max(200, args.calls // 10)
                cases.append((kind, synchronous, max_batch, calls))
    results = []
    for kind, synchronous, max_batch, calls in cases:
        result = asyncio.run(run_case(kind, synchronous, max_batch, calls, args.concurrency, args))
        results.append(result)
        if not args.json:
            print(
                f"{result['store']:<12} max_batch={max_batch:<4} {result['calls']:>6} calls  "
                f"{result['calls_per_s']:>8.0f} calls/s  "
                f"{result['cpu_ms_per_call']:.3f} ms CPU/call  "
                f"{result['bytes_per_token']:.2f} bytes/token",
                flush=True,
            )
    by = {(r["store"], r["max_batch"]): r for r in results}
    for (store, batch), r in by.items():
        if batch > 1 and (store, 1) in by:
            r["vs_no_group_commit"] = r["calls_per_s"] / by[(store, 1)]["calls_per_s"]
            if not args.json:
                print(f"{store}: group commit {r['vs_no_group_commit']:.1f}x one txn per op")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
