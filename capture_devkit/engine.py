"""Start and stop a real vLLM OpenAI-compatible server as a child process (DESIGN §7).

::

    with VLLMServer(model_dir) as server:
        httpx.get(server.base_url + "/v1/models")

The server runs in its own process group (``start_new_session``) so :meth:`VLLMServer.stop` can
signal everything it spawned: SIGTERM to the group, SIGKILL after a grace period. Output goes to a
log file whose tail is put into the :class:`EngineError` when the server dies
or does not become healthy in time.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from capture_contracts.errors import CaptureError


class EngineError(CaptureError):
    """The local vLLM process could not be started, or died."""

    error_type = "engine_error"


LAUNCHER = "vllm.entrypoints.launchers.api_server.entry"
#: Context for OpenCode-sized prompts (~9.5k-character system prompt + ~10 tool schemas, ~4k
#: tokens with the tiny model's tokenizer) plus a long multi-turn history.
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024  # 512 B/token for the tiny model → ~128k tokens
ENGINE_ENV = {
    # DESIGN §7's setting. It reaches vLLM's offline engine only: the API server (AsyncLLM)
    # always runs its engine core as a process of its own (``VLLM::EngineCore``).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
#: Variables removed from the inherited environment (the KV cache is sized by a flag instead).
ENGINE_ENV_REMOVED = ("VLLM_CPU_KVCACHE_SPACE",)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class VLLMServer:
    """One vLLM server process group serving one model directory on a loopback port."""

    def __init__(
        self,
        model_dir: Path,
        *,
        served_model_name: str = "tiny",
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        seed: int = 0,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 120.0,
        stop_grace_s: float = 15.0,
        python: str = sys.executable,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.served_model_name = served_model_name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.seed = seed
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        """Server root without ``/v1`` (as :class:`~capture_proxy.settings.UpstreamSettings`)."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python, "-m", LAUNCHER,
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed),
            "--enforce-eager",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            # vLLM 0.32 on CPU dies ("CPU Generator does not use offset") when a request with
            # its own `seed` has its prefill split over two steps: it rewinds the request's
            # generator, which only CUDA generators allow. Whole prefills never split.
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(self.max_model_len),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV_REMOVED}
        return env | ENGINE_ENV | self.extra_env

    def start(self) -> VLLMServer:
        """Launch the server and block until ``/health`` answers 200 (or raise EngineError)."""
        if self.process is not None:
            raise EngineError("vLLM server already started")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    start_new_session=True,
                )
            except OSError as exc:
                raise EngineError(f"cannot launch vLLM: {exc}") from exc
        atexit.register(self.stop)
        try:
            self._wait_healthy(began)
        except BaseException as exc:
            try:
                self.stop()
            except EngineError as stop_exc:
                exc.add_note(stop_exc.message)
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _wait_healthy(self, began: float) -> None:
        assert self.process is not None
        deadline = began + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise EngineError(
                        f"vLLM exited with status {code} during startup; log "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"vLLM not healthy after {self.startup_timeout_s:.0f} s; log "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after the grace period."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is None:
            return
        pgid = process.pid  # start_new_session: the leader's pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline and _group_alive(pgid, process):
            time.sleep(0.1)
        if _group_alive(pgid, process):
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and _group_alive(pgid, process):
                time.sleep(0.05)
        if _group_alive(pgid, process):
            raise EngineError(f"vLLM process group {pgid} survived SIGKILL")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-64 * 1024 :].decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int, leader: subprocess.Popen[bytes]) -> bool:
    """True while a live (non-zombie) member of the group exists.

    Orphaned members are reparented to PID 1, which in a container may never reap them, so a
    zombie member counts as gone; the leader, our child, is reaped here.
    """
    leader.poll()
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, …
        if int(fields[2]) == pgid and fields[0] not in {"Z", "X"}:
            return True
    return False
