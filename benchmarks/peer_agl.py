"""The peer gateway for bench_proxy.py: Agent Lightning 1.0.2's ``agl-server`` (issue 11).

``agentlightning==1.0.2`` needs Python 3.12 while this project runs on 3.11, so it lives in its own
venv (``.venv-agl/`` at the repository root, git-ignored), made once by :func:`ensure_venv` with
the package index pip is configured for.

How the peer is driven, as read from its source (``agentlightning/server/``):

- ``agl-server`` is a Hydra app (``config/server.yaml``): overrides go on the command line as
  ``key=value``; Hydra writes ``outputs/<date>/<time>/`` into the working directory, so we run it in
  a temporary one. The store is in memory (module-level dicts); every proxied call is appended there
  as a ``model_request`` event holding the whole request and response, so its RSS grows with calls.
- The gateway ignores the request's ``model``: it picks servers registered under the *configured*
  ``default_proxy.model_name`` and overwrites ``model`` (and, in train mode, ``temperature``,
  ``return_token_ids: true``, ``logprobs: true``) in the forwarded body. We set that name to
  :data:`MODEL` and register the stub under it with ``POST /api/models``
  ``[{"model": MODEL, "endpoint": "<upstream>/v1"}]`` (the endpoint includes the OpenAI base path).
- ``POST /api/rollouts`` takes a list of ``RolloutCreate``; ``{"input": ...}`` is the only required
  field, and a caller-chosen ``rollout_id`` makes creation idempotent. The proxy path for a rollout
  is ``/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/chat/completions``; the attempt id
  is free text (``0`` is the default attempt).
- ``"stream": true`` is refused with 400 ``{"detail": "Streaming responses are not supported"}``
  before anything is forwarded; non-streaming answers are re-serialised from the parsed upstream
  JSON (so the token ids and logprobs the engine sent come back to the client).
- Auth is off unless ``key`` is set; health is ``GET /healthz``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from measuring import stop_group

from capture_devkit.engine import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-agl"
PACKAGE = "agentlightning"
VERSION = "1.0.2"
PYTHON312 = Path("/root/.pyenv/versions/3.12.1/bin/python3.12")
MODEL = "stub"


@dataclass(frozen=True)
class PeerTarget:
    """A running ``agl-server`` with the stub registered and rollouts created."""

    pid: int
    port: int
    paths: tuple[str, ...]
    """One chat-completions proxy path per rollout, for round robin."""
    model: str
    """The name the gateway forwards to; it overwrites whatever the request body says."""


def _python312() -> str:
    override = os.environ.get("BENCH_AGL_PYTHON")
    if override:
        return override
    if PYTHON312.exists():
        return str(PYTHON312)
    found = shutil.which("python3.12")
    if found is None:
        raise RuntimeError(f"{PACKAGE}=={VERSION} needs Python 3.12; set BENCH_AGL_PYTHON")
    return found


def _installed_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version('{PACKAGE}'))"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_venv(venv: Path = VENV) -> Path:
    """The venv with ``agentlightning==1.0.2`` (made on first use; a no-op once it is there)."""
    if _installed_version(venv) == VERSION:
        return venv
    if not (venv / "bin" / "python").exists():
        subprocess.run([_python312(), "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{PACKAGE}=={VERSION}"],
        check=True,
    )
    if _installed_version(venv) != VERSION:
        raise RuntimeError(f"{venv}: {PACKAGE}=={VERSION} did not install")
    return venv


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"agl-server exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"agl-server not healthy at {url} in {timeout_s} s")


def _register(base: str, upstream_url: str, rollouts: int) -> tuple[str, ...]:
    models = [{"model": MODEL, "endpoint": f"{upstream_url.rstrip('/')}/v1"}]
    httpx.post(f"{base}/api/models", json=models).raise_for_status()
    created = httpx.post(
        f"{base}/api/rollouts",
        json=[{"input": {"data_id": f"bench-{i}"}, "is_train": True} for i in range(rollouts)],
    )
    created.raise_for_status()
    return tuple(
        f"/proxy/rollout/{r['rollout_id']}/attempt/0/mode/train/openai/v1/chat/completions"
        for r in created.json()
    )


@contextmanager
def peer(upstream_url: str, rollouts: int = 16, venv: Path = VENV) -> Iterator[PeerTarget]:
    """Run ``agl-server`` (own process group, loopback, free port) in front of ``upstream_url``."""
    server = ensure_venv(venv) / "bin" / "agl-server"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="agl-") as workdir:
        log = Path(workdir) / "agl-server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    str(server),
                    "host=127.0.0.1",
                    f"port={port}",
                    f"default_proxy.model_name={MODEL}",
                ],
                cwd=workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_healthy(f"{base}/healthz", proc, log, timeout_s=60)
            paths = _register(base, upstream_url, rollouts)
            yield PeerTarget(pid=proc.pid, port=port, paths=paths, model=MODEL)
        finally:
            stop_group(proc)


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]) if len(sys.argv) > 1 else VENV))
