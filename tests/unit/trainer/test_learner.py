"""The learner on a tiny Qwen2: logprob alignment, layout and micro-batch invariance, updates."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from capture_contracts.rows import Row
from tests.support.rowkit import make_row, simple_rows, token_ids
from trainer_bridge.batch import TrainBatch, collate
from trainer_bridge.errors import TrainerError
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in learner.model.named_parameters()
    }


def _on_policy(learner: Learner, batch: TrainBatch) -> TrainBatch:
    """The batch with behaviour logprobs = the learner's own (ratio exactly 1 before the step)."""
    logp = learner.token_logprobs(batch)
    return dataclasses.replace(batch, behavior_logprobs=logp * batch.loss_mask)


def test_token_logprobs_are_aligned_with_their_token(tiny_model_dir: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir)
    ids = token_ids(9, seed=5)
    batch = collate([make_row("r", "e", "g", 0.0, ids, [(1, 9)])])
    logp = learner.token_logprobs(batch)[0]  # [T]
    assert logp[0].item() == 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            # Position t holds log π(ids[t] | ids[:t]), computed here from the prefix alone.
            prefix = torch.tensor([ids[:t]])
            logits = learner.model(input_ids=prefix).logits[0, -1]
            want = torch.log_softmax(logits, dim=-1)[ids[t]].item()
            assert logp[t].item() == pytest.approx(want, abs=1e-5)


def test_padding_does_not_change_logprobs(tiny_model_dir: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir)
    short = make_row("a", "e", "g", 0.0, token_ids(5, seed=1), [(2, 5)])
    long = make_row("b", "e", "g", 0.0, token_ids(17, seed=2), [(2, 17)])
    alone = learner.token_logprobs(collate([short]))[0]
    padded = learner.token_logprobs(collate([short, long]))[0]
    torch.testing.assert_close(padded[:5], alone, atol=1e-5, rtol=0)
    assert torch.all(padded[5:] == 0)


# Plain SGD without clipping: the update is linear in the gradient, so a wrongly scaled gradient
# would show in the weights (Adam's first step and clipping are blind to the gradient's scale).
EXACT = LearnerConfig(optimizer="sgd", lr=0.5, max_grad_norm=math.inf)


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_micro_batching_does_not_change_the_update(
    tiny_model_dir: Path, micro_batch_size: int
) -> None:
    batch = with_advantages(collate(simple_rows(num_episodes=4, rows_per_episode=2)))
    whole = Learner.from_dir(tiny_model_dir, EXACT)
    split = Learner.from_dir(
        tiny_model_dir, dataclasses.replace(EXACT, micro_batch_size=micro_batch_size)
    )
    a, b = whole.step(batch), split.step(batch)
    assert b.micro_batches == -(-batch.num_rows // micro_batch_size) and a.micro_batches == 1
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5, abs=1e-6), field
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    before = dict(Learner.from_dir(tiny_model_dir).model.named_parameters())
    assert any(not torch.equal(before[name], p) for name, p in whole.model.named_parameters())


def _forest(prompt_len: int = 5) -> dict[str, list[int]]:
    """Token pieces of one episode: parent call 1, a worker call, parent call 2."""
    return {
        "p": token_ids(prompt_len, seed=10),  # parent prompt
        "a": token_ids(4, seed=11),  # parent completion 1 (delegates)
        "w": token_ids(6, seed=12),  # worker prompt
        "c": token_ids(3, seed=13),  # worker completion
        "r": token_ids(5, seed=14),  # worker answer pasted back (prompt tokens of the parent)
        "b": token_ids(3, seed=15),  # parent completion 2
    }


def _merged_rows(f: dict[str, list[int]]) -> list[Row]:
    p, a, w, c, r, b = (f[k] for k in "pawcrb")
    parent = p + a + r + b
    n_pa, n_par = len(p + a), len(p + a + r)
    return [
        make_row("ep/0", "ep", "g", 1.0, parent, [(len(p), n_pa), (n_par, len(parent))]),
        make_row("ep/1", "ep", "g", 1.0, w + c, [(len(w), len(w + c))]),
        make_row("other/0", "other", "g", 0.0, token_ids(9, seed=16), [(4, 9)]),
    ]


def _per_call_rows(f: dict[str, list[int]]) -> list[Row]:
    p, a, w, c, r, b = (f[k] for k in "pawcrb")
    return [
        make_row("ep/call-1", "ep", "g", 1.0, p + a, [(len(p), len(p + a))]),
        make_row("ep/call-2", "ep", "g", 1.0, w + c, [(len(w), len(w + c))]),
        make_row(
            "ep/call-3", "ep", "g", 1.0, p + a + r + b, [(len(p + a + r), len(p + a + r + b))]
        ),
        make_row("other/0", "other", "g", 0.0, token_ids(9, seed=16), [(4, 9)]),
    ]


def test_merged_rows_give_the_per_call_loss_and_gradient(tiny_model_dir: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir)
    merged = with_advantages(collate(_merged_rows(_forest())))
    per_call = with_advantages(collate(_per_call_rows(_forest())))
    assert merged.owned_tokens == per_call.owned_tokens == 4 + 3 + 3 + 5
    # Behaviour logprobs off-policy by a constant, so the ratio is not 1 and the clip matters.
    merged, per_call = (
        dataclasses.replace(x, behavior_logprobs=(learner.token_logprobs(x) - 0.1) * x.loss_mask)
        for x in (merged, per_call)
    )
    learner.optimizer.zero_grad(set_to_none=True)
    acc_merged = learner.accumulate(merged, num_tokens=merged.owned_tokens)
    g_merged = _grads(learner)
    learner.optimizer.zero_grad(set_to_none=True)
    acc_per_call = learner.accumulate(per_call, num_tokens=per_call.owned_tokens)
    g_per_call = _grads(learner)
    assert acc_merged.loss == pytest.approx(acc_per_call.loss, rel=1e-5, abs=1e-6)
    assert acc_merged.loss != 0.0
    for name, g in g_merged.items():
        torch.testing.assert_close(g, g_per_call[name], atol=1e-6, rtol=1e-4, msg=name)
    assert sum(float(g.norm()) for g in g_merged.values()) > 0


def _span_logprob(learner: Learner, batch: TrainBatch, row: int, span: slice) -> float:
    return float(learner.token_logprobs(batch)[row, span].sum())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_real_update_moves_the_worker_span(tiny_model_dir: Path, sign: float) -> None:
    f = _forest()
    rows = _merged_rows(f)
    if sign < 0:  # negate the advantage: the good episode becomes the bad one
        rows = [dataclasses.replace(r, reward=1.0 - r.reward) for r in rows]
    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-3))
    batch = _on_policy(learner, with_advantages(collate(rows)))
    worker_row = batch.row_ids.index("ep/1")
    span = slice(len(f["w"]), len(f["w"]) + len(f["c"]))
    assert batch.advantages is not None
    assert torch.all(batch.advantages[worker_row, span] == 0.5 * sign)

    # The gradient restricted to the worker span (loss on those tokens only) is non-zero.
    only_span = torch.zeros_like(batch.loss_mask)
    only_span[worker_row, span] = 1.0
    restricted = dataclasses.replace(
        batch, loss_mask=only_span, advantages=batch.advantages * only_span
    )
    learner.accumulate(restricted, num_tokens=int(only_span.sum()))
    assert sum(float(g.norm()) for g in _grads(learner).values()) > 1e-4
    learner.optimizer.zero_grad(set_to_none=True)

    before = _span_logprob(learner, batch, worker_row, span)
    stats = learner.step(batch)
    after = _span_logprob(learner, batch, worker_row, span)
    assert stats.mean_ratio == pytest.approx(1.0) and stats.clip_fraction == 0.0
    if sign > 0:
        assert after > before + 1e-3
    else:
        assert after < before - 1e-3


def test_grad_norm_is_reported_before_clipping(tiny_model_dir: Path) -> None:
    batch = with_advantages(collate(simple_rows()))
    probe = Learner.from_dir(tiny_model_dir)
    probe.accumulate(batch, num_tokens=batch.owned_tokens)
    unclipped = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in _grads(probe).values()])
    ).item()
    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(max_grad_norm=1e-3))
    stats = learner.step(batch)
    assert stats.grad_norm == pytest.approx(unclipped, rel=1e-5)
    assert stats.grad_norm > 1e-3
    assert (stats.owned_tokens, stats.rows, stats.episodes) == (
        batch.owned_tokens,
        batch.num_rows,
        batch.num_episodes,
    )


def test_save_writes_a_servable_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-2))
    learner.step(with_advantages(collate(simple_rows())))
    out = learner.save(tmp_path / "out")
    names = {p.name for p in out.iterdir()}
    source = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert source <= names  # nothing a server needs is left behind
    reloaded = Learner.from_dir(out)
    for (name, p), q in zip(
        learner.model.named_parameters(), reloaded.model.parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=name)
    original = Learner.from_dir(tiny_model_dir)
    changed = any(
        not torch.equal(p, q)
        for p, q in zip(original.model.parameters(), reloaded.model.parameters(), strict=True)
    )
    assert changed


def test_a_batch_without_advantages_or_owned_tokens_is_refused(tiny_model_dir: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir)
    batch = collate(simple_rows())
    with pytest.raises(TrainerError, match="no advantages"):
        learner.step(batch)
    nothing = dataclasses.replace(
        with_advantages(batch), loss_mask=torch.zeros_like(batch.loss_mask)
    )
    with pytest.raises(TrainerError, match="owns no tokens"):
        learner.step(nothing)


def test_optimizer_state_is_saved_and_restored(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A resumed run goes on with the same Adam moments: the next step is the same update."""
    from tests.support.rowkit import simple_rows
    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages

    batch = with_advantages(collate(simple_rows()))
    config = LearnerConfig(lr=1e-3)
    first = Learner.from_dir(tiny_model_dir, config)
    first.step(batch)
    first.save(tmp_path / "v1", optimizer=True)
    resumed = Learner.from_dir(tmp_path / "v1", config)
    assert resumed.load_optimizer(tmp_path / "v1")
    assert not Learner.from_dir(tiny_model_dir, config).load_optimizer(tiny_model_dir)
    first.step(batch)
    resumed.step(batch)
    for (name, p), q in zip(
        first.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, atol=1e-7, rtol=1e-6, msg=name)
