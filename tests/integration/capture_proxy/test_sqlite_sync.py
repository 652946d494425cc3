"""What reaches the disk when, on SQLite with ``store.sqlite_synchronous=FULL``: the syscalls.

A completion's commit syncs the WAL (``fdatasync``) before its future settles, so before the
harness is answered — on the writer thread, or on the caller's for a lone call; an admission's
commit does not (nothing is promised of a call until its completion commits, and the
completion's sync covers the admission, written to the WAL before it).
``NORMAL`` syncs neither. Counted with strace on a real store in a process of its own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    from capture_proxy.store.db import make_engine, make_sessionmaker, upgrade_async
    from capture_proxy.store.leases import InstanceIdentity
    from capture_proxy.store.records import Admission, Generation
    from capture_proxy.store.repository import Store

    def mark(name):
        os.write(2, f"--{name}\\n".encode())

    async def main(url, synchronous):
        await upgrade_async(url)
        store = Store(
            make_sessionmaker(make_engine(url)),
            sqlite_synchronous=synchronous,
            identity=InstanceIdentity.new(),
        )
        ep = (await store.create_episode("sync")).episode_id
        admission = Admission("chat", False, 1, "policy", "agent")
        gen = Generation([1, 2, 3], [4, 5], [-0.5, -0.25], "stop")
        for alone in (False, False, False, True, True, True):
            mark("admit")
            ids = await store.admit(ep, admission)
            mark("complete_alone" if alone else "complete")
            await store.writer.complete(ep, ids, [gen], alone=alone)
        mark("fail")
        ids = await store.admit(ep, admission)
        mark("finish")
        await store.finish(ep, ids, "failed", "engine refused")
        mark("end")
        await store.aclose()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _syncs_per_step(tmp_path: Path, synchronous: str) -> dict[str, list[int]]:
    """For each marked step, the fsync/fdatasync calls the process made during it."""
    strace = shutil.which("strace")
    assert strace is not None, "strace is needed (scripts/install-env.sh installs it)"
    script = tmp_path / "sync.py"
    script.write_text(SCRIPT)
    url = f"sqlite+aiosqlite:///{tmp_path / f'{synchronous}.db'}"
    trace = tmp_path / f"{synchronous}.strace"
    out = subprocess.run(
        [strace, "-f", "-qq", "-o", str(trace), "-e", "trace=fsync,fdatasync,write",
         "-e", "signal=none", sys.executable, str(script), url, synchronous],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    steps: dict[str, list[int]] = {}
    current: list[int] | None = None
    for line in trace.read_text().splitlines():
        marker = re.search(r'write\(2, "--(\w+)\\n"', line)
        if marker:  # the process marked the start of a step
            current = steps.setdefault(marker.group(1), [])
            current.append(0)
        elif current is not None and re.search(r"\bf(data)?sync\(", line):
            current[-1] += 1
    return steps


def test_a_completion_syncs_its_commit_and_an_admission_does_not(tmp_path: Path) -> None:
    """A lone call's completion (``alone``: committed on the caller's thread) syncs as well."""
    full = _syncs_per_step(tmp_path, "FULL")
    assert full["admit"] == [0] * 6, full
    assert len(full["complete"]) == 3 and all(n >= 1 for n in full["complete"]), full
    assert len(full["complete_alone"]) == 3 and all(n >= 1 for n in full["complete_alone"]), full
    assert full["finish"][0] >= 1, full  # a failure is recorded durably too
    normal = _syncs_per_step(tmp_path, "NORMAL")
    assert normal["admit"] == [0] * 6 and normal["complete"] == [0, 0, 0], normal
    assert normal["complete_alone"] == [0, 0, 0], normal
