"""Loss and gradient over the reconstructed rows equal those over the per-call reference.

A small causal model (embedding → GRU → linear, float64) scores every next token; the loss is a
token sum over owned positions that also uses the behaviour logprobs (an importance-ratio term), so
misaligned logprobs or masks would show. Rows come from the forest code; the reference rows (one
per eligible call) from :mod:`reconstruct.reference`, which shares none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings

from reconstruct import reconstruct_episode
from tests.golden.make_golden import SCENARIOS
from tests.oracles.reference import reference_rows
from tests.support.strategies import episodes

torch.set_num_threads(1)


class TinyCausalModel(torch.nn.Module):
    def __init__(self, vocab: int, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, dtype=torch.float64)
        self.gru = torch.nn.GRU(width, width, batch_first=True, dtype=torch.float64)
        self.head = torch.nn.Linear(width, vocab, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(input_ids))  # [1, T, W]
        logits: torch.Tensor = self.head(hidden)  # [1, T, V]
        return logits


def token_sum_loss(
    model: TinyCausalModel,
    rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
) -> torch.Tensor:
    """Σ over owned positions of ``-logp + 0.5 · exp(logp - behavior_logp)``."""
    total = torch.zeros((), dtype=torch.float64)
    for input_ids, loss_mask, behavior in rows:
        assert loss_mask[0] == 0  # position 0 has no prediction; prompts are never empty here
        ids = torch.tensor([list(input_ids)], dtype=torch.long)  # [1, T]
        mask = torch.tensor(list(loss_mask)[1:], dtype=torch.float64)  # [T-1]
        old = torch.tensor(list(behavior)[1:], dtype=torch.float64)  # [T-1]
        logits = model(ids[:, :-1])[0]  # [T-1, V]
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T-1]
        ratio = torch.exp(logp - old)  # [T-1]
        total = total + (mask * (-logp + 0.5 * ratio)).sum()
    return total


def _loss_and_grads(
    model: TinyCausalModel, rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = token_sum_loss(model, rows)
    params = list(model.parameters())
    if not loss.requires_grad:  # no rows at all
        return loss, [torch.zeros_like(p) for p in params]
    return loss.detach(), list(torch.autograd.grad(loss, params))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes(max_steps=20))
def test_rows_and_per_call_reference_give_the_same_loss_and_gradient(
    bundle: dict[str, Any],
) -> None:
    vocab = 1 + max(
        (t for c in bundle["calls"] for t in c["prompt_token_ids"] + c["completion_token_ids"]),
        default=0,
    )
    torch.manual_seed(0)
    model = TinyCausalModel(vocab)
    result = reconstruct_episode(bundle)
    rows = [
        (r.input_ids.tolist(), r.loss_mask.tolist(), r.behavior_logprobs.tolist())
        for r in result.rows
    ]
    reference = [(r.input_ids, r.loss_mask, r.behavior_logprobs) for r in reference_rows(bundle)]
    assert sum(sum(m) for _, m, _ in rows) == sum(sum(m) for _, m, _ in reference)

    loss_rows, grads_rows = _loss_and_grads(model, rows)
    loss_ref, grads_ref = _loss_and_grads(model, reference)
    torch.testing.assert_close(loss_rows, loss_ref, rtol=0.0, atol=1e-9)
    for g_rows, g_ref in zip(grads_rows, grads_ref, strict=True):
        torch.testing.assert_close(g_rows, g_ref, rtol=0.0, atol=1e-9)


def test_agreement_is_not_vacuous() -> None:
    """A row layout that drops the ownership rule (mask every span) does change the loss."""
    bundle = SCENARIOS["shared_prefix_fork"]()
    torch.manual_seed(0)
    model = TinyCausalModel(64)
    result = reconstruct_episode(bundle)
    wrong = []
    for row in result.rows:
        mask = [0] * len(row.input_ids)
        for span in row.spans:
            mask[span.start : span.end] = [1] * (span.end - span.start)
        wrong.append((row.input_ids.tolist(), mask, row.behavior_logprobs.tolist()))
    reference = [(r.input_ids, r.loss_mask, r.behavior_logprobs) for r in reference_rows(bundle)]
    with torch.no_grad():
        gap = token_sum_loss(model, wrong) - token_sum_loss(model, reference)
    assert abs(gap.item()) > 1e-3
