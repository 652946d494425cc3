"""One Ray Train run for many steps (trainer_bridge/ray_session.py): the workers stay up, and
each step is the one-process update (2 CPU workers, DDP over gloo, SGD without clipping)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from tests.support.rowkit import simple_rows
from trainer_bridge.batch import collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.ray_session import RaySession, SessionConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_two_steps_in_one_session_equal_two_local_steps(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = simple_rows(num_episodes=4, rows_per_episode=3)
    exact = LearnerConfig(optimizer="sgd", lr=0.5, max_grad_norm=math.inf)
    local = Learner.from_dir(tiny_model_dir, exact)
    want = [local.step(with_advantages(collate(rows))) for _ in range(2)]

    session = RaySession(tiny_model_dir, tiny_model_dir, SessionConfig(learner=exact))
    try:
        got = [session.step(rows, version=v) for v in range(2)]
        assert session._thread.is_alive()  # the same run between and after the steps
        session.save(tmp_path / "out")
    finally:
        session.close()
    assert not session._thread.is_alive()
    for one, two in zip(want, got, strict=True):
        assert two["rows"] == one.rows and two["owned_tokens"] == one.owned_tokens
        assert sorted(two["shard_rows"]) == [6, 6]
        for field in ("loss", "grad_norm", "mean_ratio", "approx_kl"):
            assert two[field] == pytest.approx(getattr(one, field), rel=1e-5, abs=1e-6), field
    # Hand-made rows carry no sampling version: reported, not guessed.
    assert got[1]["staleness"]["unknown_tokens"] == want[1].owned_tokens
    saved = Learner.from_dir(tmp_path / "out")
    assert (tmp_path / "out" / "optimizer.pt").is_file()
    for (name, p), q in zip(local.model.named_parameters(), saved.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
