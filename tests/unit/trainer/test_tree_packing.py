"""Tree packing gives the padded learner's logprobs, loss, gradient and update.

float64 (the tiny Qwen2 cast to double): loss and every parameter's gradient equal to 1e-9 on the
golden corpus (tests/golden/*.json, reconstructed) and on Hypothesis batches — shared system
prompts across episodes, forks, compactions (a continued pre-compaction context and a rewritten
root), ``n > 1`` siblings, and identical rows in different episodes that own the same positions
with different advantages. float32: weights after one SGD and one AdamW step equal to 1e-5.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_contracts.rows import Row
from capture_proxy.cli import main as capture_proxy
from reconstruct import reconstruct_episode
from tests.support.rowkit import make_row, token_ids
from tests.support.strategies import episodes
from trainer_bridge.batch import TrainBatch, collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Accumulated, Learner, LearnerConfig
from trainer_bridge.loss import LossConfig
from trainer_bridge.rows_io import write_jsonl

GOLDEN = Path(__file__).parents[2] / "golden"
EXACT = LearnerConfig(optimizer="sgd", lr=0.5, max_grad_norm=math.inf)


def _rms_norm_in_own_dtype(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def double_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny Qwen2 in float64 throughout.

    Hugging Face's ``Qwen2RMSNorm`` computes in float32 whatever the model's dtype (forward and,
    through the casts, backward), which limits any two summation orders to ~1e-7 relative
    agreement; the norms here compute the same formula in the model's dtype.
    """
    model = Learner.from_dir(tiny_model_dir).model.to(torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_in_own_dtype, module)
    return model


def _learners(model: torch.nn.Module, config: LearnerConfig = EXACT) -> dict[str, Learner]:
    """One learner per packing over the *same* model (only gradients are compared)."""
    return {p: Learner(model, dataclasses.replace(config, packing=p)) for p in ("padded", "tree")}


def _loss_and_grads(
    learner: Learner, batch: TrainBatch
) -> tuple[Accumulated, dict[str, torch.Tensor]]:
    learner.optimizer.zero_grad(set_to_none=True)
    acc = learner.accumulate(batch, num_tokens=batch.owned_tokens)
    grads = {
        name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in learner.model.named_parameters()
    }
    learner.optimizer.zero_grad(set_to_none=True)
    return acc, grads


def _off_policy(learner: Learner, batch: TrainBatch, shift: float = 0.3) -> TrainBatch:
    """Behaviour logprobs = the model's own, moved by ``±shift``: ratios ≠ 1, some clipped."""
    logp = learner.token_logprobs(batch).to(torch.float32)  # [B, T]
    sign = torch.where(torch.arange(logp.shape[1]) % 2 == 0, 1.0, -1.0)  # [T]
    return dataclasses.replace(batch, behavior_logprobs=(logp + shift * sign) * batch.loss_mask)


def _assert_same_update(model: torch.nn.Module, rows: Sequence[Row], atol: float = 1e-9) -> None:
    learners = _learners(model)
    batch = with_advantages(collate(rows))
    batch = _off_policy(learners["padded"], batch)
    padded, g_padded = _loss_and_grads(learners["padded"], batch)
    tree, g_tree = _loss_and_grads(learners["tree"], batch)
    assert tree.loss == pytest.approx(padded.loss, rel=0, abs=atol)
    for name in ("clip_fraction", "approx_kl", "mean_ratio"):
        assert getattr(tree, name) == pytest.approx(getattr(padded, name), rel=0, abs=atol), name
    for name, g in g_padded.items():
        torch.testing.assert_close(g_tree[name], g, rtol=0, atol=atol, msg=name)
    assert tree.computed_tokens <= batch.row_tokens


def _trainer_rows(bundle: dict[str, Any], *, episode: str, reward: float) -> list[Row]:
    """A bundle's reconstructed rows as trainer rows of ``episode`` in group ``g``."""
    return [
        Row(
            row_id=f"{episode}/{i}",
            episode_id=episode,
            group_id="g",
            reward=reward,
            input_ids=tuple(int(t) for t in r.input_ids),
            loss_mask=tuple(int(m) for m in r.loss_mask),
            behavior_logprobs=tuple(float(x) for x in r.behavior_logprobs),
        )
        for i, r in enumerate(reconstruct_episode(bundle).rows)
    ]


def test_tree_logprobs_equal_padded_at_every_position(double_model: torch.nn.Module) -> None:
    # A shared prompt, a fork, a row that is a prefix of another, a lone row.
    p = token_ids(6, seed=1)
    rows = [
        make_row("a", "e1", "g", 0.0, [*p, 7, 8, 9], [(6, 9)]),
        make_row("b", "e2", "g", 1.0, [*p, 7, 5], [(6, 8)]),
        make_row("c", "e2", "g", 1.0, p[:4], [(2, 4)]),
        make_row("d", "e3", "g", 0.5, token_ids(5, seed=2), [(1, 5)]),
    ]
    batch = collate(rows)
    learners = _learners(double_model)
    padded = learners["padded"].token_logprobs(batch)  # [B, T]
    tree = learners["tree"].token_logprobs(batch)  # [B, T]
    torch.testing.assert_close(tree, padded, rtol=0, atol=1e-12)
    assert torch.all(tree[:, 0] == 0) and torch.all(tree[batch.attention_mask == 0] == 0)


def test_golden_corpus_same_loss_and_gradient(double_model: torch.nn.Module) -> None:
    rows: list[Row] = []
    for i, path in enumerate(sorted(GOLDEN.glob("*.json"))):
        bundle = json.loads(path.read_text())["bundle"]
        # One group, distinct rewards: every episode has a non-zero advantage. The golden token
        # ids are small integers, so episodes share prefixes with each other as well.
        rows += _trainer_rows(bundle, episode=path.stem, reward=float(i % 5))
    assert len(rows) > 20
    _assert_same_update(double_model, rows)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(episodes(max_steps=10), min_size=2, max_size=3), st.randoms())
def test_reconstructed_hypothesis_episodes_same_loss_and_gradient(
    double_model: torch.nn.Module, bundles: list[dict[str, Any]], rng: Any
) -> None:
    rows: list[Row] = []
    for i, bundle in enumerate(bundles):
        rows += _trainer_rows(bundle, episode=f"ep{i}", reward=rng.choice([0.0, 1.0, 0.25]))
    if sum(r.owned_tokens for r in rows) == 0:
        return
    _assert_same_update(double_model, rows)


@st.composite
def harness_groups(draw: st.DrawFn) -> list[Row]:
    """A GRPO group as harnesses make it, in miniature (tokens from a small alphabet).

    Every episode's root rows start with the group's system prompt + task; an episode has a
    parent row, optionally a fork (a worker branching from the parent's context), a compaction
    (a row continuing the parent's context with a summary, and a rewritten root: system prompt +
    summary + more turns) and ``n = 2`` siblings (same prompt, two completions). Some episodes
    are exact copies of another with a different reward: the same tokens owned twice.
    """
    alphabet = st.integers(1, 6)
    system = draw(st.lists(alphabet, min_size=1, max_size=8))
    num_episodes = draw(st.integers(2, 4))
    rows: list[Row] = []

    def add(episode: int, ids: list[int], prompt_len: int, reward: float) -> None:
        logprobs = draw(st.lists(st.floats(-4.0, -0.1), min_size=len(ids), max_size=len(ids)))
        owned = max(1, prompt_len)
        rows.append(
            Row(
                row_id=f"e{episode}/{len(rows)}",
                episode_id=f"e{episode}",
                group_id="g",
                reward=reward,
                input_ids=tuple(ids),
                loss_mask=tuple(int(i >= owned) for i in range(len(ids))),
                behavior_logprobs=tuple(lp if i >= owned else 0.0 for i, lp in enumerate(logprobs)),
            )
        )

    def turns(n_max: int = 6) -> list[int]:
        return draw(st.lists(alphabet, min_size=1, max_size=n_max))

    for e in range(num_episodes):
        reward = draw(st.sampled_from([0.0, 1.0, 0.5, -1.0]))
        if e > 0 and draw(st.integers(0, 3)) == 0:  # a copy of an earlier episode
            for row in [r for r in rows if r.episode_id == "e0"]:
                mask = row.loss_mask.tolist()
                owned = mask.index(1) if 1 in mask else len(mask)
                add(e, list(row.input_ids), owned, reward)
            continue
        task = turns()
        prompt = system + task
        parent = prompt + turns()
        add(e, parent, len(prompt), reward)
        if draw(st.booleans()):  # a worker forked from the parent's context
            cut = draw(st.integers(1, len(parent)))
            add(e, parent[:cut] + turns(), cut, reward)
        if draw(st.booleans()):  # compaction: summary call row, then the rewritten root
            summary = turns()
            add(e, parent + turns(3) + summary, len(parent) + 1, reward)
            root = system + summary
            add(e, root + turns(), len(root), reward)
        if draw(st.booleans()):  # n = 2 siblings on one prompt
            add(e, prompt + turns(), len(prompt), reward)
            add(e, prompt + turns(), len(prompt), reward)
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(harness_groups())
def test_harness_like_groups_same_loss_and_gradient(
    double_model: torch.nn.Module, rows: list[Row]
) -> None:
    _assert_same_update(double_model, rows)


def test_two_rows_owning_the_same_tokens_both_count(double_model: torch.nn.Module) -> None:
    # Episodes e1 (reward 1) and e2 (reward 0) sampled the very same answer; e3 (reward 0.5)
    # something else. Advantages: 1 − 0.5 = 0.5, 0 − 0.5 = −0.5, 0.
    # Under the unclipped loss −A·r, with the same tokens and the same behaviour logprobs, e1's
    # and e2's terms are −0.5·r and +0.5·r: they cancel, and the whole loss is 0 — a tree that
    # kept one loss term per shared position would not cancel.
    prompt, answer = token_ids(5, seed=3), token_ids(4, seed=4)
    rows = [
        make_row("e1/0", "e1", "g", 1.0, prompt + answer, [(5, 9)], logprob=-8.0),
        make_row("e2/0", "e2", "g", 0.0, prompt + answer, [(5, 9)], logprob=-8.0),
        make_row("e3/0", "e3", "g", 0.5, prompt + token_ids(4, seed=5), [(5, 9)], logprob=-8.0),
    ]
    batch = with_advantages(collate(rows))
    unclipped = dataclasses.replace(EXACT, loss=LossConfig(name="importance_pg"))
    for learner in _learners(double_model, unclipped).values():
        acc, grads = _loss_and_grads(learner, batch)
        assert acc.loss == pytest.approx(0.0, abs=1e-12)
        assert max(float(g.abs().max()) for g in grads.values()) < 1e-12
    # Dropping e2 leaves e1's term alone: the loss is no longer 0 (not vacuous).
    alone = with_advantages(collate([rows[0], rows[2]]))
    for learner in _learners(double_model, unclipped).values():
        acc, _ = _loss_and_grads(learner, alone)
        assert abs(acc.loss) > 1e-3
    _assert_same_update(double_model, rows)


def _shared_rows() -> list[Row]:
    system = token_ids(24, seed=20)
    rows = []
    for e in range(4):
        task = token_ids(6, seed=30 + e)
        rows.append(make_row(f"e{e}/0", f"e{e}", "g", float(e), system + task, [(24, 30)]))
        worker = system[:10] + token_ids(5, seed=40 + e)
        rows.append(make_row(f"e{e}/1", f"e{e}", "g", float(e), worker, [(10, 15)]))
    return rows


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fp32_weights_after_one_step_equal(tiny_model_dir: Path, optimizer: str) -> None:
    config = LearnerConfig(optimizer=optimizer, lr=1e-2 if optimizer == "sgd" else 1e-3)
    batch = with_advantages(collate(_shared_rows()))
    base = Learner.from_dir(tiny_model_dir).model
    padded = Learner(copy.deepcopy(base), dataclasses.replace(config, packing="padded"))
    tree = Learner(copy.deepcopy(base), dataclasses.replace(config, packing="tree"))
    batch = _off_policy(padded, batch)
    a, b = padded.step(batch), tree.step(batch)
    assert (a.packing, b.packing) == ("padded", "tree")
    assert a.row_tokens == b.row_tokens == batch.row_tokens == 4 * (30 + 15)
    assert a.computed_tokens == batch.input_ids.numel() == 8 * 30  # pads included
    # Tree: the 24 system tokens once, each task (6) and worker tail (5) once, minus each
    # row's last token (it predicts nothing): 24 + 4·(5 + 4) = 60.
    assert b.computed_tokens == 24 + 4 * (5 + 4)
    assert b.step_seconds > 0
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5, abs=1e-6), field
    moved = 0.0
    for (name, p), q in zip(padded.model.named_parameters(), tree.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((p - base.get_parameter(name)).detach().abs().max()))
    assert moved > 1e-4


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_tree_micro_batching_does_not_change_the_update(
    tiny_model_dir: Path, micro_batch_size: int
) -> None:
    batch = with_advantages(collate(_shared_rows()))
    tree = dataclasses.replace(EXACT, packing="tree")
    whole = Learner.from_dir(tiny_model_dir, tree)
    split = Learner.from_dir(
        tiny_model_dir, dataclasses.replace(tree, micro_batch_size=micro_batch_size)
    )
    a, b = whole.step(batch), split.step(batch)
    assert b.micro_batches == -(-batch.num_rows // micro_batch_size)
    assert b.computed_tokens >= a.computed_tokens  # less sharing inside smaller micro-batches
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5, abs=1e-6), field
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


def test_train_step_packing_flag(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(_shared_rows(), path)
    stats = {}
    for packing in ("padded", "tree"):
        argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir), "--json"]
        argv += ["--out", str(tmp_path / packing), "--packing", packing, "--optimizer", "sgd"]
        assert capture_proxy(argv) == 0
        stats[packing] = json.loads(capsys.readouterr().out)
    padded, tree = stats["padded"], stats["tree"]
    assert (padded["packing"], tree["packing"]) == ("padded", "tree")
    assert padded["row_tokens"] == tree["row_tokens"] == 4 * (30 + 15)
    assert (padded["computed_tokens"], tree["computed_tokens"]) == (8 * 30, 24 + 4 * (5 + 4))
    assert tree["step_seconds"] > 0 and padded["step_seconds"] > 0
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert tree[field] == pytest.approx(padded[field], rel=1e-5, abs=1e-6), field
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir)]
    assert capture_proxy([*argv, "--out", str(tmp_path / "x"), "--packing", "dense"]) == 1
    assert "unknown packing 'dense'" in capsys.readouterr().err


def test_a_micro_batch_that_owns_nothing(tiny_model_dir: Path) -> None:
    # Row "a/0" is conditioning only; with one row per micro-batch its tree scores nothing.
    rows = [
        make_row("a/0", "a", "g", 1.0, token_ids(8, seed=90)),
        make_row("b/0", "b", "g", 0.0, token_ids(8, seed=91), [(3, 8)]),
        make_row("c/0", "c", "g", 0.5, token_ids(8, seed=92), [(2, 8)]),
    ]
    batch = with_advantages(collate(rows))
    config = dataclasses.replace(EXACT, micro_batch_size=1)
    steps = {
        packing: Learner.from_dir(tiny_model_dir, dataclasses.replace(config, packing=packing))
        for packing in ("padded", "tree")
    }
    a, b = (learner.step(batch) for learner in steps.values())
    # Rows b and c run up to their last predicting position (7 of 8 tokens), row a not at all.
    assert b.micro_batches == 3 and b.computed_tokens == 7 + 7
    assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
