"""Issue 16's acceptance: ``capture-proxy train --iterations 20 --group-size 8`` on this machine.

A subprocess as a user runs it. It must finish within 20 minutes; the mean reward of the last 5
iterations must beat the first 5 by ``MARGIN``; every call's weight version rises with the
iterations; iteration 0 is on-policy (mean ratio 1 ± 1e-3, approx KL < 1e-3). Figures over 3
seeds (and the parent-only comparison): docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capture_devkit.train.report import read_records, summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET_S = 20 * 60
#: Last-5 minus first-5 mean reward. Measured over seeds 0, 1, 2: +0.408, +0.055, +0.247
#: (docs/benchmarks.md; the policy collapses onto one capitalised token, which one depends on the
#: seed). The first five iterations' means spread by ~0.005 around 0.09, so 0.04 is far above
#: noise and below every seed measured.
MARGIN = 0.04


def test_twenty_iterations_learn_within_twenty_minutes(tmp_path: Path) -> None:
    out = tmp_path / "train"
    argv = [sys.executable, "-m", "capture_proxy.cli", "train", "--out", str(out)]
    argv += ["--iterations", "20", "--group-size", "8", "--seed", "0"]
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUDGET_S + 120)
    elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed <= BUDGET_S, f"{elapsed:.0f} s"
    records = read_records(out)
    assert [r["iteration"] for r in records] == list(range(20))
    figures = summary(records)
    assert figures["last_mean"] - figures["first_mean"] >= MARGIN, figures
    versions = [r["weight_versions"] for r in records]
    assert versions == [[i] for i in range(20)]  # one version per iteration, rising
    for path in sorted((out / "bundles" / "iter-0019").glob("*.json")):
        assert {c["weight_version"] for c in json.loads(path.read_text())["calls"]} == {19}
    first = records[0]
    assert abs(first["mean_ratio"] - 1.0) <= 1e-3 and first["approx_kl"] < 1e-3, first
    print(f"20 iterations in {elapsed:.0f} s: {figures}")
