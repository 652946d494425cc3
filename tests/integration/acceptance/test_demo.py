"""`capture-proxy demo` end to end, as a user runs it (a subprocess with its own vLLM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_writes_everything(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "capture_proxy.cli", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "learner step" in done.stdout
    bundles = sorted((out / "bundles").glob("*.json"))
    assert len(bundles) == 4
    for path in bundles:
        bundle = json.loads(path.read_text())
        assert bundle["status"] == "closed"
        assert len(bundle["calls"]) == 10
    rows = [r for p in (out / "rows").glob("rows-*.parquet") for r in pq.read_table(p).to_pylist()]
    for path in bundles:  # the proxy's viewer page (GET /episodes/{id}/view), one per episode
        page = (out / "html" / f"{path.stem}.html").read_text()
        assert page.startswith("<!doctype") and page.count('class="call-node"') == 10
        own_rows = sum(1 for r in rows if r["episode_id"] == path.stem)
        assert page.count('<div class="row"') == own_rows > 0
    assert {r["episode_id"] for r in rows} == {p.stem for p in bundles}
    accounting = json.loads((out / "accounting.json").read_text())
    for episode in accounting["accounting"].values():
        assert sum(episode["counts"].values()) == episode["n_calls"] == 10
    # Stitched calls are rendered from the model's chat template in the proxy once their head
    # shape has agreed with the engine's render (the first stitch of a shape asks the engine).
    figures = accounting["episodes"].values()
    assert all(0 <= f["rendered_here"] <= f["stitched"] and f["stitched"] > 0 for f in figures)
    assert sum(f["rendered_here"] for f in figures) > 0
    for f in figures:  # (the summary's cell: stitched calls, those rendered in the proxy)
        assert f"{f['stitched']} ({f['rendered_here']})" in done.stdout
    train = json.loads((out / "train.json").read_text())
    assert train["episodes"] == 4
    assert train["rows"] == len(rows)
    # Grammar-forced tool calls are owned but kept out of the loss (their logprobs are of the
    # masked distribution); what is trained is sampled freely, so one step on the sampling
    # weights is on-policy: ratio 1, KL 0 (issue 16 item 3).
    owned = sum(sum(r["loss_mask"]) for r in rows)
    assert train["owned_tokens"] + train["constrained_tokens"] == owned
    assert train["constrained_tokens"] > 0 and train["owned_tokens"] > 0
    assert abs(train["mean_ratio"] - 1.0) <= 1e-3, train["mean_ratio"]
    assert train["approx_kl"] < 1e-3, train["approx_kl"]
    assert set(train["advantage_signed_logprob_change_by_agent"]) == {
        "parent",
        "worker-a",
        "worker-b",
    }
    # Nothing the demo started is left behind: its vLLM log says the server shut down.
    assert (out / "vllm.log").exists()
    print(f"demo took {elapsed:.0f} s")


def _processes() -> list[tuple[int, int, str]]:
    """(pid, process group, command line) of every live process (zombies are left out)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found.append((int(proc.name), int(fields[2]), cmdline))
    return found


def test_demo_stops_everything_when_terminated(tmp_path: Path) -> None:
    """SIGTERM (``kill``, ``timeout``, a container's stop) ends the demo as Ctrl-C does — both are
    a KeyboardInterrupt in it (capture_devkit/signals.py; Ctrl-C's own path is
    test_engine_cli.py's) — and vLLM's process group, which the signal does not reach, goes too."""
    out = tmp_path / "interrupted"
    demo = subprocess.Popen(
        [sys.executable, "-m", "capture_proxy.cli", "demo", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert demo.stdout is not None
    seen = []
    try:
        for line in demo.stdout:  # wait until vLLM and the proxy run and episodes are going
            seen.append(line)
            if "running" in line:
                break
        # vLLM runs in its own process group (its EngineCore renames itself, so find the group)
        groups = {pgid for _, pgid, cmd in _processes() if str(out) in cmd} - {os.getpgid(0)}
        assert groups, "the demo's vLLM should be running by now"
        demo.send_signal(signal.SIGTERM)
        rest, _ = demo.communicate(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, "".join(seen) + rest

    def left() -> list[str]:
        return [cmd for _, pgid, cmd in _processes() if pgid in groups]

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == [], "vLLM (or its EngineCore) outlived the demo"
