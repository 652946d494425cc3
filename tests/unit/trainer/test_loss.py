"""The token-level clipped policy-gradient loss: hand-computed cases and a plain-loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_bridge.errors import TrainerError
from trainer_bridge.loss import LOSSES, LossConfig, policy_loss


def test_ratio_one_is_minus_the_mean_owned_advantage() -> None:
    # logp == behaviour → ratio 1 everywhere; clip(1) = 1, so token loss = −A.
    # Owned tokens (mask 1): A = 2, −1, 0.5 → loss = −(2 − 1 + 0.5) / 3 = −0.5.
    # The unowned token (A = 9) is masked out.
    behavior = torch.tensor([[-1.0, -2.0, -3.0, -0.5]])
    logp = behavior.clone().requires_grad_(True)
    adv = torch.tensor([[9.0, 2.0, -1.0, 0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    loss, stats = policy_loss(logp, behavior, adv, mask, num_tokens=3)
    assert loss.item() == pytest.approx(-0.5)
    assert stats.clip_fraction.item() == 0.0
    assert stats.approx_kl.item() == pytest.approx(0.0, abs=1e-7)
    assert stats.mean_ratio.item() == pytest.approx(1.0)
    # d loss / d logp_t = −A_t · ratio_t / N = −A_t / 3 on owned tokens, 0 elsewhere.
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.0, -2 / 3, 1 / 3, -0.5 / 3])


def test_ratio_e_with_clipping() -> None:
    # logp − behaviour = 1 → ratio e ≈ 2.71828 on both owned tokens, ε = 0.2.
    # Token 1, A = +1: max(−1·e, −1·clip(e, 0.8, 1.2)) = max(−2.718, −1.2) = −1.2 (clipped:
    #   no gradient).
    # Token 2, A = −1: max(+e, +1.2) = e (unclipped: gradient −A·r = e).
    # loss = (−1.2 + e) / 2 ≈ 0.75914; clip fraction 1/2; mean ratio e;
    # approx KL per token (r − 1) − log r = e − 2 → mean e − 2 ≈ 0.71828.
    behavior = torch.tensor([[0.0, -2.0, -3.0]])
    logp = (behavior + torch.tensor([[0.0, 1.0, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[0.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, stats = policy_loss(logp, behavior, adv, mask, num_tokens=2, cfg=LossConfig(clip_eps=0.2))
    e = math.e
    assert loss.item() == pytest.approx((-1.2 + e) / 2)
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    assert stats.mean_ratio.item() == pytest.approx(e)
    assert stats.approx_kl.item() == pytest.approx(e - 2)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, e / 2])


Grid = list[list[float]]


def _loop_loss(
    logp: Grid, behavior: Grid, adv: Grid, mask: Grid, num_tokens: int, eps: float
) -> tuple[float, float]:
    """Token by token, in Python floats: the definition, written out."""
    total = 0.0
    clipped = 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if mask[b][t] == 0:
                continue
            a = adv[b][t]
            r = math.exp(logp[b][t] - behavior[b][t])
            total += max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            clipped += int((r > 1 + eps and a > 0) or (r < 1 - eps and a < 0))
    return total / num_tokens, clipped / num_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_equals_plain_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (5, 11)
    behavior = -torch.rand(shape, generator=g) * 5
    logp = behavior + torch.randn(shape, generator=g) * 0.4
    adv = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) < 0.6).float()
    n = int(mask.sum())
    loss, stats = policy_loss(logp, behavior, adv, mask, num_tokens=n)
    want_loss, want_clip = _loop_loss(
        logp.double().tolist(), behavior.double().tolist(), adv.tolist(), mask.tolist(), n, 0.2
    )
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert stats.clip_fraction.item() == pytest.approx(want_clip)
    assert 0 < want_clip < 1  # the case exercises both branches


def test_slices_with_the_global_count_add_up_to_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    behavior = -torch.rand(6, 9, generator=g) * 3
    logp = behavior + torch.randn(6, 9, generator=g) * 0.3
    adv = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) < 0.5).float()
    n = int(mask.sum())
    full, full_stats = policy_loss(logp, behavior, adv, mask, num_tokens=n)
    parts = [
        policy_loss(logp[s], behavior[s], adv[s], mask[s], num_tokens=n)
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    assert sum(p[0].item() for p in parts) == pytest.approx(full.item(), rel=1e-6)
    for i in range(3):
        assert sum(p[1][i].item() for p in parts) == pytest.approx(full_stats[i].item(), rel=1e-6)


def test_kl_to_reference_is_off_by_default_and_added_when_asked() -> None:
    behavior = torch.tensor([[0.0, -1.0, -1.0]])
    logp = torch.tensor([[0.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    base, _ = policy_loss(logp, behavior, adv, mask, num_tokens=2, ref_logprobs=ref)
    assert base.item() == pytest.approx(-1.0)  # ref ignored while kl_coef == 0
    # k3 at token 1: d = ref − logp = −1 → e^−1 + 1 − 1 = e^−1; token 2: d = 0 → 0.
    # loss = −1 + 0.5 · e^−1 / 2.
    with_kl, _ = policy_loss(
        logp, behavior, adv, mask, num_tokens=2, cfg=LossConfig(kl_coef=0.5), ref_logprobs=ref
    )
    assert with_kl.item() == pytest.approx(-1.0 + 0.5 * math.exp(-1) / 2)
    with pytest.raises(TrainerError, match="no reference logprobs"):
        policy_loss(logp, behavior, adv, mask, num_tokens=2, cfg=LossConfig(kl_coef=0.5))


def test_registry() -> None:
    assert set(LOSSES) >= {"clipped_pg", "importance_pg"}
    behavior = torch.tensor([[0.0, -2.0]])
    logp = torch.tensor([[0.0, -1.0]])  # ratio e
    adv = torch.tensor([[0.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0]])
    plain, stats = policy_loss(
        logp, behavior, adv, mask, num_tokens=1, cfg=LossConfig(name="importance_pg")
    )
    assert plain.item() == pytest.approx(-math.e)  # no clip: −A·r
    assert stats.clip_fraction.item() == 0.0
    with pytest.raises(TrainerError, match="unknown loss 'nope'"):
        policy_loss(logp, behavior, adv, mask, num_tokens=1, cfg=LossConfig(name="nope"))
    with pytest.raises(TrainerError, match="owns no tokens"):
        policy_loss(logp, behavior, adv, mask * 0, num_tokens=0)
