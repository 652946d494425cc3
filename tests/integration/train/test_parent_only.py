"""The loop in parent-only mode: the workers' calls are conditioning only (role ``auxiliary``),
so only the parent's calls are trained (one iteration of 2 episodes; issue 16 acceptance)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from capture_devkit.train.report import read_records
from trainer_bridge.rows_io import read_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_parent_only_training_trains_the_parent_alone(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "capture_proxy.cli", "train", "--training", "parent_only"]
    argv += ["--iterations", "1", "--group-size", "2", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = read_records(out)
    assert record["rows"] > 0 and record["owned_tokens"] > 0
    agent_of = {}
    for path in (out / "bundles" / "iter-0000").glob("*.json"):
        for call in json.loads(path.read_text())["calls"]:
            agent_of[call["call_id"]] = call["agent_id"]
            assert (call["role"] == "auxiliary") == (call["agent_id"] != "parent")
    owners = {
        agent_of[s.call_id]
        for r in read_rows(out / "rows" / "iter-0000")
        for s in r.spans
        if s.owned
    }
    assert owners == {"parent"}
    reports = [json.loads(p.read_text()) for p in (out / "rows" / "iter-0000").glob("report-*")]
    classes = {
        agent_of[call]: cls
        for report in reports
        for episode in report["episodes"].values()
        for call, cls in episode["classification"].items()
        if agent_of[call] != "parent"
    }
    assert set(classes.values()) == {"conditioning_only"}
