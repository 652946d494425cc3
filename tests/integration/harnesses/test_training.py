"""Both harness layouts of one task train through the trainer bridge (issue 6).

A parent-only LangGraph episode (the supervisor answers alone) and a parent-plus-workers episode
(the supervisor fans out with ``Send``) are attempts at the same task: one GRPO group, rewards 0
and 1. The reconstruction job exports them from the store; each episode then gets one learner step
with its group advantage (−0.5 and +0.5). The step on the worker episode trains the workers'
actions: their logprobs rise; the parent-only episode's owned logprobs fall.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage

from capture_devkit.engine import VLLMServer
from capture_proxy.reconstruct_job import run_job
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory
from tests.integration.harnesses.episode import call_infos, close_episode, open_episode
from tests.integration.harnesses.test_langgraph import (
    SUPERVISOR_SYSTEM,
    TASK,
    build_graph,
    chat_model,
)
from trainer_bridge.batch import TrainBatch, collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.rows_io import read_rows

pytestmark = pytest.mark.vllm

GROUP = "langgraph-fruit"


def _owned_logprob_sum(learner: Learner, batch: TrainBatch, positions: torch.Tensor) -> float:
    logprobs = learner.token_logprobs(batch)  # [B, T]
    return float((logprobs * positions).sum())


async def test_parent_only_and_parent_plus_workers_each_train_one_step(
    vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Path, tiny_model_dir: Path
) -> None:
    db = sqlite_url(tmp_path / "capture.db")
    proxy = proxy_factory(db, upstream_url=vllm_server.base_url)
    model = vllm_server.served_model_name

    alone = open_episode(proxy.url, GROUP)
    supervisor = chat_model(alone.base_url, model, "supervisor", None, seed=1)
    await supervisor.ainvoke([SystemMessage(SUPERVISOR_SYSTEM), HumanMessage(TASK)])
    close_episode(proxy.url, alone, reward=0.0)

    with_workers = open_episode(proxy.url, GROUP)
    await build_graph(with_workers.base_url, model).ainvoke({"task": TASK})
    close_episode(proxy.url, with_workers, reward=1.0)
    worker_calls = {
        c["call_id"]
        for c in call_infos(proxy.url, with_workers)
        if c["agent_id"] in {"worker-a", "worker-b"}
    }
    assert len(worker_calls) == 2

    out = tmp_path / "rows"
    report = await run_job(db, out, show_progress=False)
    assert sorted(report.exported_episodes) == sorted([alone.episode_id, with_workers.episode_id])

    rows = read_rows(out)
    group = with_advantages(collate(rows))
    expected = {alone.episode_id: -0.5, with_workers.episode_id: 0.5}
    for episode_id, advantage in expected.items():
        e = group.episode_ids.index(episode_id)
        index = [i for i in range(group.num_rows) if int(group.episode_index[i]) == e]
        batch = group.select(index)
        assert batch.advantages is not None
        owned = batch.loss_mask > 0  # [B, T]
        assert torch.allclose(batch.advantages[owned], torch.tensor(advantage))

        # The positions this step trains; for the worker episode, only the workers' actions.
        positions = batch.loss_mask.clone()
        if episode_id == with_workers.episode_id:
            positions = torch.zeros_like(batch.loss_mask)
            for b, row_id in enumerate(batch.row_ids):
                row = next(r for r in rows if r.row_id == row_id)
                for span in row.spans:
                    if span.owned and span.call_id in worker_calls:
                        positions[b, span.start : span.end] = 1.0
            assert positions.sum() > 0, "the step contains worker actions"

        learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-3))
        before = _owned_logprob_sum(learner, batch, positions)
        stats = learner.step(batch)
        after = _owned_logprob_sum(learner, batch, positions)
        assert math.isfinite(stats.loss) and stats.grad_norm > 0
        assert stats.rows == len(index) and stats.owned_tokens == int(batch.loss_mask.sum())
        assert (after - before) * advantage > 0, (episode_id, before, after)

    # The same rows through the command line: one step over the whole group.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "capture_proxy.cli",
            "train-step",
            "--rows",
            str(out),
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path / "model"),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["episodes"] == 2 and stats["rows"] == len(rows)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert (tmp_path / "model" / "config.json").exists()
