"""Real processes for fault and load tests: the proxy (`capture-proxy serve`) and the stub engine.

Each runs in its own process group with its output in a log file beside the test's files, so a
test can ``kill -9`` it (``kill()``), stop it cleanly (``stop()``), start it again on the same
port (``start()``) and read its peak RSS (``peak_rss_mb()``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx

from capture_devkit.engine import free_port

READY_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


def ctrl_c_as_at_a_terminal() -> None:
    """``preexec_fn`` for a child a test stops with SIGINT, as Ctrl-C would: the default
    disposition, whatever this process inherited. A shell without job control starts its
    background commands with SIGINT ignored, an ignored signal stays ignored across ``exec``,
    and Python then installs no KeyboardInterrupt handler — so a test suite started that way
    (``( make test & )``) would see the child ignore the signal, not the code under test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Process:
    """One service process on a loopback port, restartable."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        port: int,
        env: Mapping[str, str] | None = None,
        ready_path: str = "/health",
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    def start(self) -> Self:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() ends all of it
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} did not become ready: {self.log_tail()}")

    def kill(self) -> None:
        """``kill -9`` of the whole process group: nothing runs its shutdown."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM and wait (a clean shutdown); SIGKILL if it does not end."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def peak_rss_mb(self) -> float:
        """The process's peak resident set (VmHWM) so far."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc status")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def stub_engine(log_dir: Path, port: int | None = None) -> Process:
    """The fake engine (tests/support/stub_engine.py) as a process; not started."""
    port = port or free_port()
    argv = [sys.executable, "-m", "tests.support.stub_engine", "--port", str(port)]
    return Process(f"engine-{port}", argv, log_dir, port=port)


def proxy(
    log_dir: Path,
    db_url: str,
    upstream_url: str,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Process:
    """``capture-proxy serve`` as an operator runs it; not started. Settings via ``env``."""
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "capture_proxy.cli",
        "serve",
        "--port",
        str(port),
        "--db",
        db_url,
        "--upstream",
        upstream_url,
        "--log-level",
        "warning",
    ]
    return Process(f"proxy-{port}", argv, log_dir, port=port, env=env)
