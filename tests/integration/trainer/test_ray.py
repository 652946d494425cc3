"""Ray Data + Ray Train (2 CPU workers, DDP over gloo) give the 1-worker update."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray  # a missing Ray fails these tests; it never skips them
import torch

from capture_proxy.cli import main as capture_proxy
from tests.support.rowkit import make_row, simple_rows, token_ids
from trainer_bridge.batch import collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.rows_io import write_parquet


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance sized for this 2-core machine, shared by the module's tests."""
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


@pytest.mark.slow
def test_two_ray_workers_equal_one_learner(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 13 rows: Ray Train's default split (equal=True) would silently drop one to even the shards.
    extra = make_row("ep0/9", "ep0", "g0", 0.0, token_ids(11, seed=7), [(3, 11)], logprob=-6.0)
    rows = [*simple_rows(num_episodes=4, rows_per_episode=3), extra]
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    write_parquet(rows[:7], rows_dir / "part-0.parquet")
    write_parquet(rows[7:], rows_dir / "part-1.parquet")
    # SGD without clipping: the update is linear in the gradient, so a gradient scaled wrongly
    # across ranks (DDP averages, the loss must sum) would show in the weights.
    exact = LearnerConfig(optimizer="sgd", lr=0.5, max_grad_norm=math.inf)

    one = Learner.from_dir(tiny_model_dir, exact)
    want = one.step(with_advantages(collate(rows)))

    # Through the CLI (`train-step --workers 2`), on the cluster started by the fixture.
    argv = ["train-step", "--rows", str(rows_dir), "--model", str(tiny_model_dir)]
    argv += ["--out", str(tmp_path / "out"), "--json", "--workers", "2", "--optimizer", "sgd"]
    argv += ["--lr", "0.5", "--max-grad-norm", "inf", "--micro-batch-size", "2"]
    assert capture_proxy(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["rows"], got["episodes"], got["owned_tokens"]) == (
        want.rows,
        want.episodes,
        want.owned_tokens,
    )
    assert got["micro_batches"] >= 13 // 2  # summed over ranks: each runs ⌈its rows / 2⌉
    # Both workers really trained: no shard is empty (rows are repartitioned per worker).
    assert len(got["shard_rows"]) == 2 and min(got["shard_rows"]) >= 4, got["shard_rows"]
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert got[field] == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-6), field

    two = Learner.from_dir(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    before = dict(Learner.from_dir(tiny_model_dir).model.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in two.model.named_parameters())
