"""The captured acceptance episode through reconstruction and the trainer bridge.

Exact conditioning of rows, masks, complete accounting, once-only loss, one logical-rollout
contribution to the GRPO baseline, loss/gradient agreement with the per-call reference, a real
learner update containing worker actions, closing safety and the single-agent baselines.
The proxy runs with ``continuation: stitch`` (the default): each context is one row. (On the tiny
model re-tokenisation drift is total, DESIGN §7, so in pass-through mode most continuations would
be new roots.) These tests assert the invariants; test_capture.py checks the row count.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from capture_contracts.rows import Row as TrainRow
from capture_devkit.harness import close_episode, fetch_bundle, open_episode
from reconstruct import Reconstruction, parse_bundle, reconstruct_episode
from reconstruct.errors import EpisodeRefused
from reconstruct.invariants import invariant_violations
from tests.fixtures.proxy import ProxyServer
from tests.integration.acceptance.conftest import Captured, EpisodeRunner
from tests.oracles.reference import reference_rows
from trainer_bridge.batch import TrainBatch, collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.rows_io import row_from_dict

pytestmark = pytest.mark.vllm


def _owners(result: Reconstruction) -> dict[str, int]:
    owned: dict[str, int] = {}
    for row in result.rows:
        for span in row.spans:
            owned[span.call_id] = owned.get(span.call_id, 0) + int(span.owned)
    return owned


def test_rows_are_the_exact_conditioning_plus_sample(captured: Captured) -> None:
    bundle = parse_bundle(captured.bundle)
    result = reconstruct_episode(bundle)
    assert invariant_violations(bundle, result) == []
    calls = {c["call_id"]: c for c in captured.bundle["calls"]}
    for row in result.rows:
        end = calls[row.endpoint_call_id]
        assert row.input_ids.tolist() == end["prompt_token_ids"] + end["completion_token_ids"]
        for span in row.spans:
            call = calls[span.call_id]
            assert row.input_ids[span.start : span.end].tolist() == call["completion_token_ids"]
            if span.owned:
                got = row.behavior_logprobs[span.start : span.end].tolist()
                assert got == pytest.approx(call["completion_logprobs"], abs=1e-6)


def test_masks_once_only_and_worker_answers_masked(captured: Captured) -> None:
    result = reconstruct_episode(captured.bundle)
    owners = _owners(result)
    assert owners == {c.call_id: 1 for c in captured.trace.calls}  # every generation once
    lengths = {c["call_id"]: len(c["completion_token_ids"]) for c in captured.bundle["calls"]}
    assert sum(int(r.loss_mask.sum()) for r in result.rows) == sum(lengths.values())
    final = captured.call("parent.final")
    (final_row,) = [r for r in result.rows if r.endpoint_call_id == final["call_id"]]
    prompt_len = len(final["prompt_token_ids"])
    # The worker answers are pasted into this prompt as tool results: observations, mask 0. With
    # stitching (the default) the parent's context is one row: its prompt also holds the parent's
    # own delegation, the only other loss in it.
    delegate = captured.call("parent.delegate")
    in_prompt = [s for s in final_row.spans if s.owned and s.start < prompt_len]
    assert [s.call_id for s in in_prompt] == [delegate["call_id"]]
    (span,) = in_prompt
    assert (span.start, span.end) == (
        len(delegate["prompt_token_ids"]),
        len(delegate["prompt_token_ids"]) + lengths[delegate["call_id"]],
    )
    expected = [0] * prompt_len
    expected[span.start : span.end] = [1] * (span.end - span.start)
    assert final_row.loss_mask[:prompt_len].tolist() == expected
    assert final_row.loss_mask[prompt_len:].tolist() == [1] * lengths[final["call_id"]]
    parent_ids = {c.call_id for c in captured.trace.by_agent("parent")}
    assert {s.call_id for s in final_row.spans if s.owned} <= parent_ids


def test_compaction_is_trained_by_default_and_can_be_excluded(captured: Captured) -> None:
    compact = captured.trace.step("worker-a.compact").call_id
    default = reconstruct_episode(captured.bundle)
    assert default.accounting.classification[compact] == "trained"
    assert _owners(default)[compact] == 1
    policy_only = reconstruct_episode(captured.bundle, trainable_roles={"policy"})
    assert _owners(policy_only).get(compact, 0) == 0
    assert policy_only.accounting.classification[compact] == "conditioning_only"
    others = {c.call_id for c in captured.trace.calls} - {compact}
    assert {k for k, v in _owners(policy_only).items() if v} == others


def test_accounting_is_complete(captured: Captured) -> None:
    accounting = reconstruct_episode(captured.bundle).accounting
    assert accounting.n_calls == len(captured.bundle["calls"]) == 10
    assert set(accounting.classification) == {c["call_id"] for c in captured.bundle["calls"]}
    assert sum(accounting.counts.values()) == accounting.n_calls
    assert accounting.counts["trained"] == 10


def _train_rows(result: Reconstruction) -> list[TrainRow]:
    return [row_from_dict(r.to_dict()) for r in result.rows]


def _reference_train_rows(bundle: dict[str, Any]) -> list[TrainRow]:
    """One row per eligible call; its completion is one span, constrained as the call was (so
    the trainer keeps grammar-forced tokens out of both layouts' loss alike)."""
    constrained = {c["call_id"]: c.get("constraint") is not None for c in bundle["calls"]}
    return [
        row_from_dict(
            {
                "row_id": f"{bundle['episode_id']}/ref/{i:03d}",
                "episode_id": bundle["episode_id"],
                "group_id": bundle["group_id"],
                "reward": bundle["reward"],
                "input_ids": list(r.input_ids),
                "loss_mask": list(r.loss_mask),
                "behavior_logprobs": list(r.behavior_logprobs),
                "spans": [
                    {
                        "call_id": r.call_id,
                        "start": len(r.input_ids) - sum(r.loss_mask),
                        "end": len(r.input_ids),
                        "owned": True,
                        "constrained": constrained[r.call_id],
                    }
                ],
            }
        )
        for i, r in enumerate(reference_rows(bundle))
    ]


def _loss_and_grads(model_dir: Path, batch: TrainBatch) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    learner = Learner.from_dir(model_dir, LearnerConfig())
    learner.optimizer.zero_grad(set_to_none=True)
    acc = learner.accumulate(batch, num_tokens=batch.owned_tokens)
    grads = [p.grad.clone() for p in learner.model.parameters() if p.grad is not None]
    return acc.loss, grads


@pytest.fixture(scope="module")
def group(captured: Captured, episode_runner: EpisodeRunner) -> list[Captured]:
    """The acceptance episode plus two more attempts at the same task (one parent-only)."""

    async def more() -> list[Captured]:
        return [
            await episode_runner.run(group_id="accept", seed=2, reward=0.0),
            await episode_runner.run(group_id="accept", seed=3, reward=0.0, mode="parent_only"),
        ]

    return [captured, *asyncio.run(more())]


def test_rows_and_per_call_reference_agree_on_loss_and_gradient(
    group: list[Captured], model_dir: Path
) -> None:
    rows = [r for c in group for r in _train_rows(reconstruct_episode(c.bundle))]
    reference = [r for c in group for r in _reference_train_rows(c.bundle)]
    assert sum(sum(r.loss_mask) for r in rows) == sum(sum(r.loss_mask) for r in reference)
    for constrained in ("exclude", "include"):  # grammar-forced tokens out of the loss, or in
        batch = with_advantages(collate(rows, constrained=constrained))
        ref_batch = with_advantages(collate(reference, constrained=constrained))
        assert batch.owned_tokens == ref_batch.owned_tokens
        assert (constrained == "exclude") == (batch.constrained_tokens > 0)
        loss, grads = _loss_and_grads(model_dir, batch)
        ref_loss, ref_grads = _loss_and_grads(model_dir, ref_batch)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_one_logical_rollout_per_episode_in_the_baseline(group: list[Captured]) -> None:
    rows = [r for c in group for r in _train_rows(reconstruct_episode(c.bundle))]
    per_episode = {c.trace.episode_id: 0 for c in group}
    for row in rows:
        per_episode[row.episode_id] += 1
    assert len(set(per_episode.values())) > 1  # row counts differ: a row-weighted mean would show
    batch = with_advantages(collate(rows))
    assert batch.advantages is not None
    rewards = {c.trace.episode_id: float(c.bundle["reward"]) for c in group}
    baseline = sum(rewards.values()) / len(rewards)
    for b, row_id in enumerate(batch.row_ids):
        episode = row_id.split("/")[0]
        owned = batch.loss_mask[b] > 0
        expected = torch.full_like(batch.advantages[b][owned], rewards[episode] - baseline)
        torch.testing.assert_close(batch.advantages[b][owned], expected)


def test_learner_update_moves_worker_actions(group: list[Captured], model_dir: Path) -> None:
    rows = [r for c in group for r in _train_rows(reconstruct_episode(c.bundle))]
    batch = with_advantages(collate(rows))
    assert batch.advantages is not None
    worker_calls = {t.call_id for c in group for t in c.trace.calls if t.step.startswith("worker-")}
    by_id = {r.row_id: r for r in rows}
    learner = Learner.from_dir(model_dir, LearnerConfig(lr=1e-3))
    before = learner.token_logprobs(batch)  # [B, T]
    stats = learner.step(batch)
    after = learner.token_logprobs(batch)  # [B, T]
    rise: list[float] = []
    for b, row_id in enumerate(batch.row_ids):
        for span in by_id[row_id].spans:
            positive = float(batch.advantages[b, span.start]) > 0
            if span.owned and span.call_id in worker_calls and positive:
                delta = after[b, span.start : span.end] - before[b, span.start : span.end]
                rise += delta.tolist()
    assert rise, "the positive-advantage episode owns worker tokens"
    assert sum(rise) / len(rise) > 0
    assert stats.owned_tokens == int(batch.loss_mask.sum())


async def test_closing_while_a_worker_streams(acceptance_proxy: ProxyServer) -> None:
    proxy = acceptance_proxy.url
    episode_id, base_url = await open_episode(proxy, "accept-close")
    worker = AsyncOpenAI(
        base_url=base_url,
        api_key="k",
        max_retries=0,
        default_headers={"X-Agent-Id": "worker-a", "X-Parent-Agent-Id": "parent"},
    )
    stream = await worker.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count every apple, slowly."}],
        max_tokens=3000,
        stream=True,
        extra_body={"min_tokens": 3000, "seed": 5},
    )
    try:
        await stream.__anext__()  # the call is admitted and generating
        refused = await close_episode(proxy, episode_id, 1.0)
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["code"] == "calls_outstanding"
        bundle = await fetch_bundle(proxy, episode_id)
        assert bundle["status"] == "closing"
        assert [c["status"] for c in bundle["calls"]] == ["admitted"]
        with pytest.raises(EpisodeRefused):  # nothing is published for unresolved calls
            reconstruct_episode(bundle)
        closed = await close_episode(proxy, episode_id, 1.0, cancel_outstanding=True)
        assert closed.status_code == 200, closed.text
    finally:
        await stream.close()
        await worker.close()
    bundle = await fetch_bundle(proxy, episode_id)
    assert bundle["status"] == "closed"
    assert [c["status"] for c in bundle["calls"]] == ["cancelled"]
    result = reconstruct_episode(bundle)
    assert result.rows == ()
    assert result.accounting.counts["cancelled"] == 1
    async with httpx.AsyncClient(base_url=proxy) as client:
        assert (await client.get(f"/episodes/{episode_id}")).json()["status"] == "closed"


def test_parent_only_baseline_and_unlabelled_single_agent(episode_runner: EpisodeRunner) -> None:
    async def both() -> tuple[Captured, Captured]:
        labelled = await episode_runner.run(
            group_id="baseline", seed=4, reward=1.0, mode="parent_only"
        )
        unlabelled = await episode_runner.run(
            group_id="baseline", seed=4, reward=1.0, mode="parent_only", labelled=False
        )
        return labelled, unlabelled

    labelled, unlabelled = asyncio.run(both())
    assert {c["agent_id"] for c in unlabelled.bundle["calls"]} == {None}
    results = []
    for run in (labelled, unlabelled):
        bundle = parse_bundle(run.bundle)
        result = reconstruct_episode(bundle)
        assert invariant_violations(bundle, result) == []
        roots = [c for c, p in result.parents.items() if p is None]
        leaves = set(result.parents) - {p for p in result.parents.values() if p is not None}
        assert len(result.rows) == len(leaves)  # one row per parent context endpoint
        assert len(roots) >= 1
        assert _owners(result) == {c.call_id: 1 for c in run.trace.calls}
        results.append(result)
    # Same seed, same script: labels change nothing about the rows.
    for a, b in zip(results[0].rows, results[1].rows, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()


def test_learner_scores_sampled_tokens_as_vllm_did(captured: Captured, model_dir: Path) -> None:
    """Behaviour logprobs of freely sampled tokens equal the learner's (same weights, float32).

    Grammar-forced tokens are left out: vLLM reports their logprobs after the structured-output
    mask, so they differ from the unmasked policy by design.
    """
    rows = _train_rows(reconstruct_episode(captured.bundle))
    free = {c.call_id for c in captured.trace.calls if "structured_outputs" not in c.request}
    batch = collate(rows)
    logprobs = Learner.from_dir(model_dir, LearnerConfig()).token_logprobs(batch)  # [B, T]
    by_id = {r.row_id: r for r in rows}
    checked = 0
    for b, row_id in enumerate(batch.row_ids):
        for span in by_id[row_id].spans:
            if span.owned and span.call_id in free:
                got = logprobs[b, span.start : span.end]
                want = batch.behavior_logprobs[b, span.start : span.end]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
                checked += span.end - span.start
    assert checked > 0
