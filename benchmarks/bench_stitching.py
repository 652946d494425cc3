"""Exact-token continuation benchmark: pass-through vs stitching on the real vLLM.

    .venv/bin/python benchmarks/bench_stitching.py [--upstream URL] [--seeds 1 2]

Runs the controlled acceptance episode (capture_devkit/harness/scripted.py: parent, two concurrent
workers, a compaction, streaming and whole calls) through the proxy once per mode and seed, then
reconstructs each closed episode. Prints per mode: calls, rows, contexts (agents + compaction
rewrites), training tokens emitted / per-call reference tokens, the fraction of calls stitched,
and the drift report (continuations that stayed token prefixes; fresh renders by reason).

Without ``--upstream`` it builds the tiny model and starts vLLM with ``--enable-scale-out``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from capture_contracts.bundle import parse_bundle
from capture_contracts.drift import bundle_drift, drift_report
from capture_devkit.engine import VLLMServer, free_port
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.tiny_model import build_tiny_model
from capture_proxy.app import create_app
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from reconstruct import reconstruct_episode

#: Contexts of the acceptance episode: parent, worker-a before and after its compaction rewrite,
#: worker-b. With exact-token continuation each becomes one row.
CONTEXTS = 4


@contextmanager
def proxy(settings: Settings) -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=settings.port, log_level="warning"
        )
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


async def _episode(proxy_url: str, seed: int, mode: str) -> dict[str, Any]:
    episode_id, base_url = await open_episode(proxy_url, f"bench-{mode}")
    await run_episode(base_url, episode_id=episode_id, group_id=f"bench-{mode}", seed=seed)
    closed = await close_episode(proxy_url, episode_id, 1.0, wait_s=5.0)
    closed.raise_for_status()
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as client:
        info = (await client.get(f"/episodes/{episode_id}")).json()
    bundle = await fetch_bundle(proxy_url, episode_id)
    assert info["continuation"] == drift_report(bundle_drift(parse_bundle(bundle)))
    return bundle


def measure(upstream: str, mode: str, seeds: list[int], workdir: Path) -> dict[str, Any]:
    settings = Settings(
        port=free_port(),
        store=StoreSettings(url=f"sqlite+aiosqlite:///{workdir / f'{mode}.db'}"),
        upstream=UpstreamSettings(url=upstream),
        continuation=mode,
    )
    totals: dict[str, Any] = {"calls": 0, "rows": 0, "row_tokens": 0, "reference_tokens": 0}
    reports = []
    with proxy(settings) as url:
        for seed in seeds:
            bundle = asyncio.run(_episode(url, seed, mode))
            accounting = reconstruct_episode(bundle).accounting
            totals["calls"] += accounting.n_calls
            totals["rows"] += accounting.rows
            totals["row_tokens"] += accounting.row_tokens
            totals["reference_tokens"] += accounting.reference_tokens
            reports.append(drift_report(bundle_drift(parse_bundle(bundle))))
    fresh: dict[str, int] = {}
    for report in reports:
        for reason, count in report["fresh"].items():
            fresh[reason] = fresh.get(reason, 0) + count
    totals |= {
        "episodes": len(seeds),
        "contexts": CONTEXTS * len(seeds),
        "stitched": sum(r["stitched"] for r in reports),
        "continuations": sum(r["continuations"] for r in reports),
        "token_prefix": sum(r["token_prefix_continuations"] for r in reports),
        "fresh": dict(sorted(fresh.items())),
    }
    return totals


def _print(mode: str, t: dict[str, Any]) -> None:
    print(
        f"{mode:<12} episodes={t['episodes']} calls={t['calls']:>3} rows={t['rows']:>3} "
        f"(contexts {t['contexts']}) emitted/reference={t['row_tokens']:,}/"
        f"{t['reference_tokens']:,}={t['row_tokens'] / t['reference_tokens']:.3f} "
        f"stitched={t['stitched']}/{t['calls']}={t['stitched'] / t['calls']:.2f}"
    )
    print(
        f"{'':<12} continuations that are token prefixes of their base call: "
        f"{t['token_prefix']}/{t['continuations']}; fresh renders by reason: {t['fresh']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM started with --enable-scale-out")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.upstream:
            results = {m: measure(args.upstream, m, args.seeds, workdir) for m in _MODES}
        else:
            model = build_tiny_model(workdir / "model")
            with VLLMServer(
                model, log_path=workdir / "vllm.log", extra_args=["--enable-scale-out"]
            ) as server:
                results = {m: measure(server.base_url, m, args.seeds, workdir) for m in _MODES}
    print("Exact-token continuation on the acceptance episode (real vLLM, tiny model)")
    for mode, totals in results.items():
        _print(mode, totals)


_MODES = ("passthrough", "stitch")

if __name__ == "__main__":
    main()
