"""Tree packing on 2 Ray Train workers (DDP over gloo) gives the padded 1-worker update."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from capture_contracts.rows import Row
from capture_proxy.cli import main as capture_proxy
from tests.integration.trainer.test_ray import ray_cluster  # noqa: F401  (the module's Ray instance)
from tests.support.rowkit import make_row, token_ids
from trainer_bridge.batch import collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig
from trainer_bridge.rows_io import write_parquet


def _group() -> list[Row]:
    """4 episodes × 3 rows sharing a system prompt; each worker forks from its parent's prompt."""
    system = token_ids(30, seed=50)
    rows = []
    for e in range(4):
        parent = system + token_ids(12, seed=60 + e)
        rows.append(make_row(f"e{e}/0", f"e{e}", "g", float(e % 3), parent, [(30, 42)]))
        worker = parent[:36] + token_ids(6, seed=70 + e)
        rows.append(make_row(f"e{e}/1", f"e{e}", "g", float(e % 3), worker, [(36, 42)]))
        summary = system[:20] + token_ids(8, seed=80 + e)
        rows.append(make_row(f"e{e}/2", f"e{e}", "g", float(e % 3), summary, [(20, 28)]))
    return rows


@pytest.mark.slow
def test_two_ray_workers_with_tree_packing_equal_one_padded_learner(
    ray_cluster: None,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _group()
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    write_parquet(rows[:6], rows_dir / "part-0.parquet")
    write_parquet(rows[6:], rows_dir / "part-1.parquet")
    exact = LearnerConfig(optimizer="sgd", lr=0.5, max_grad_norm=math.inf)
    one = Learner.from_dir(tiny_model_dir, dataclasses.replace(exact, packing="padded"))
    want = one.step(with_advantages(collate(rows)))

    argv = ["train-step", "--rows", str(rows_dir), "--model", str(tiny_model_dir)]
    argv += ["--out", str(tmp_path / "out"), "--json", "--workers", "2", "--optimizer", "sgd"]
    argv += ["--lr", "0.5", "--max-grad-norm", "inf", "--packing", "tree"]
    assert capture_proxy(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["packing"] == "tree" and min(got["shard_rows"]) >= 4, got["shard_rows"]
    assert got["row_tokens"] == want.row_tokens == sum(len(r.input_ids) for r in rows)
    # Each worker shares its own shard's prefixes: fewer tokens than the rows, more than one tree.
    assert got["computed_tokens"] < got["row_tokens"] and got["step_seconds"] > 0
    for field in ("loss", "grad_norm", "clip_fraction", "approx_kl", "mean_ratio"):
        assert got[field] == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-6), field
    two = Learner.from_dir(tmp_path / "out")
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
