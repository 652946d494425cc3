"""Claude Code and Codex episodes train through the trainer bridge (issue 13).

Per harness, a parent-only episode and a parent + two subagents episode (one compacting) are
attempts at the same task: one GRPO group, rewards 0 and 1. The reconstruction job exports them
from the store; their rows get the group advantages (−0.5, +0.5), and one learner step on the
subagent episode trains the workers' actions: their logprobs rise.

No step is taken on the parent-only episode: every token here is grammar-forced, so its behaviour
logprobs are the engine's masked ones (README, known limitations) and the importance ratio is
≪ 1; with a negative advantage the clipped objective is flat there (clip fraction 1, no
gradient) — a property of forcing, not of the capture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from capture_devkit.engine import VLLMServer
from capture_proxy.reconstruct_job import run_job
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory
from tests.integration.harnesses import test_claude_code as cc
from tests.integration.harnesses import test_codex as cx
from tests.integration.harnesses.claude_code_run import run_claude_code
from tests.integration.harnesses.codex_run import run_codex
from tests.integration.harnesses.episode import call_infos, close_episode, open_episode
from tests.integration.harnesses.script import ScriptedEngine, Step
from trainer_bridge.batch import TrainBatch, collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.rows_io import read_rows

pytestmark = pytest.mark.vllm

Run = Callable[[str, Path, bool], Any]


def _claude(base_url: str, tmp: Path, workers: bool) -> Any:
    env = cc.COMPACT_ENV if workers else None
    return run_claude_code(base_url, cc.TASK, tmp, extra_env=env)


def _codex(base_url: str, tmp: Path, workers: bool) -> Any:
    return run_codex(base_url, cx.TASK, tmp, config=cx.COMPACT_LIMIT if workers else ())


HARNESSES: dict[str, tuple[dict[str, list[Step]], dict[str, list[Step]], Run, str | None]] = {
    "claude-code": (cc.PARENT_ONLY, cc.WITH_WORKERS, _claude, cc.SUMMARY),
    "codex": (cx.PARENT_ONLY, cx.WITH_WORKERS, _codex, None),
}


@pytest.mark.parametrize("harness", sorted(HARNESSES))
async def test_parent_only_and_with_subagents_each_train_one_step(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tmp_path: Path,
    tiny_model_dir: Path,
    harness: str,
) -> None:
    parent_only, with_workers, run, summary = HARNESSES[harness]
    db = sqlite_url(tmp_path / "capture.db")
    engines: list[ScriptedEngine] = []

    def transform(body: dict[str, Any], attribution: Any) -> dict[str, Any]:
        return engines[-1](body, attribution)

    proxy = proxy_factory(
        db,
        upstream_url=vllm_server.base_url,
        upstream={"transform": transform, "served_model": vllm_server.served_model_name},
    )
    group = f"{harness}-fruit"
    children = {"BASKET-A": "worker-a", "BASKET-B": "worker-b"}
    extra = {"summary_text": summary} if summary else {}

    alone = open_episode(proxy.url, group)
    engines.append(ScriptedEngine(parent_only, **extra))
    (tmp_path / "alone").mkdir()
    run(alone.base_url, tmp_path / "alone", False)
    close_episode(proxy.url, alone, reward=0.0)

    team = open_episode(proxy.url, group)
    engine = ScriptedEngine(with_workers, children=children, **extra)
    engines.append(engine)
    (tmp_path / "team").mkdir()
    run(team.base_url, tmp_path / "team", True)
    close_episode(proxy.url, team, reward=1.0)
    infos = call_infos(proxy.url, team)
    worker_calls = {
        c["call_id"] for c in infos if engine.key_of(c["agent_id"]).startswith("worker-")
    }
    assert len(worker_calls) >= 4

    out = tmp_path / "rows"
    report = await run_job(db, out, show_progress=False)
    assert sorted(report.exported_episodes) == sorted([alone.episode_id, team.episode_id])
    rows = read_rows(out)
    # The scripted engine forces every call's text (grammar-constrained): those tokens are out of
    # the loss by default (issue 16); this test trains them to show that worker actions train.
    batches = with_advantages(collate(rows, constrained="include"))
    for episode_id, advantage in ((alone.episode_id, -0.5), (team.episode_id, 0.5)):
        e = batches.episode_ids.index(episode_id)
        index = [i for i in range(batches.num_rows) if int(batches.episode_index[i]) == e]
        batch = batches.select(index)
        assert batch.advantages is not None
        assert torch.allclose(batch.advantages[batch.loss_mask > 0], torch.tensor(advantage))
    # One step on the subagent episode (advantage +0.5): the workers' actions become likelier.
    e = batches.episode_ids.index(team.episode_id)
    index = [i for i in range(batches.num_rows) if int(batches.episode_index[i]) == e]
    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-3, micro_batch_size=1))
    before = _owned_sum(learner, batches, index, rows, worker_calls)
    stats = learner.step(batches.select(index))
    after = _owned_sum(learner, batches, index, rows, worker_calls)
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    assert stats.rows == len(index) and stats.owned_tokens == int(
        batches.select(index).loss_mask.sum()
    )
    assert after > before, (harness, before, after)


def _owned_sum(
    learner: Learner, batches: TrainBatch, index: list[int], rows: list[Any], only: set[str] | None
) -> float:
    """Σ logprob over the owned positions (of ``only``'s calls, if given), one row at a time (a
    ~25k-token row's logits are ~0.4 GB)."""
    total = 0.0
    for i in index:
        one = batches.select([i])
        row = next(r for r in rows if r.row_id == one.row_ids[0])
        positions = torch.zeros_like(one.loss_mask)  # [1, T]
        for span in row.spans:
            if span.owned and (only is None or span.call_id in only):
                positions[0, span.start : span.end] = 1.0
        total += float((learner.token_logprobs(one) * positions).sum())
    return total
