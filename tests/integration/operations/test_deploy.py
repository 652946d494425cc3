"""The sidecar image without a Docker engine: its build, its commands and compose's services.

The Dockerfile's build context (its COPY sources only) builds the wheel, which is installed into
a fresh virtualenv the way the image installs it (no extras). Then, with the image's ENV and the
compose file's proxy environment (hosts rewritten to this machine: a fresh PostgreSQL database,
the real vLLM): compose's ``migrate`` command, the image's ENTRYPOINT + CMD, its HEALTHCHECK, a
chat call through the proxy, and compose's ``reconstruct`` job following the store until an
episode's rows appear.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from capture_devkit.engine import VLLMServer, free_port
from tests.fixtures.db import PG_HOST, PG_PORT, PG_USER, _pg_admin
from tests.support.deploy import ROOT, read_compose, read_image, with_defaults

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def image_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a venv built as the image is: the wheel from the Dockerfile's COPY sources."""
    work = tmp_path_factory.mktemp("image")
    context = work / "src"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for source in read_image().copied:
        origin = ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, context / source, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(origin, context / source)
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-w", work / "dist", context, cwd=work,
    )  # fmt: skip
    (wheel,) = (work / "dist").glob("capture_proxy-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", work / "venv", cwd=work)
    pip = [work / "venv" / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    _run(*pip, "install", "-q", f"{wheel}[render]", cwd=work)  # (the Dockerfile's extra)
    return work / "venv" / "bin"


@pytest.fixture
def empty_postgres() -> Iterator[str]:
    """A new, empty PostgreSQL database (compose's migrate service creates the schema)."""
    name = f"capture_deploy_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # the test needs the service: fail, never skip
        pytest.fail(f"PostgreSQL at {PG_HOST}:{PG_PORT} is required by this test: {exc!r}")
    yield f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


ADMIN_KEY = "deploy-test-admin-key-0123456789"


def _container_env(image_env: dict[str, str], service_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPTURE_PROXY_")}
    env.pop("PYTHONPATH", None)
    return env | image_env | service_env


def _wait(url: str, proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{url} did not answer 200"
        time.sleep(0.3)


def test_image_commands_and_compose_services(
    image_bin: Path, empty_postgres: str, vllm_server: VLLMServer, tmp_path: Path
) -> None:
    image = read_image()
    services = read_compose()["services"]
    store_url = services["proxy"]["environment"]["CAPTURE_PROXY_STORE__URL"]
    port = free_port()
    here = {  # compose's host names → this machine
        store_url: empty_postgres,
        "http://vllm:8000": vllm_server.base_url,
        "http://localhost:8100": f"http://127.0.0.1:{port}",
        "/models/policy": str(vllm_server.model_dir),
    }
    proxy_env = {
        k: here.get(with_defaults(str(v)), with_defaults(str(v)))
        for k, v in services["proxy"]["environment"].items()
    }
    proxy_env["CAPTURE_PROXY_UPSTREAM__SERVED_MODEL"] = vllm_server.served_model_name
    # compose demands the admin key (the proxy listens on 0.0.0.0 in its container)
    assert ":?" in services["proxy"]["environment"]["CAPTURE_PROXY_AUTH__ADMIN_KEY"]
    proxy_env["CAPTURE_PROXY_AUTH__ADMIN_KEY"] = ADMIN_KEY
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    image_env = image.env | {"CAPTURE_PROXY_PORT": str(port)}
    env = _container_env(image_env, proxy_env)
    entry = [image_bin / image.entrypoint[0], *image.entrypoint[1:]]

    # compose: migrate
    migrate = [*entry, *services["migrate"]["command"]]
    assert "at revision" in _run(*migrate, cwd=tmp_path, env=env)
    # the image: ENTRYPOINT + CMD
    proxy = subprocess.Popen(
        [*entry, *image.cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    job: subprocess.Popen[str] | None = None
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(f"{base}/healthz", proxy)
        health = [image_bin / image.healthcheck[0], *image.healthcheck[1:]]
        assert subprocess.run(health, env=env, timeout=30).returncode == 0  # HEALTHCHECK
        ready = httpx.get(f"{base}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        created = httpx.post(
            f"{base}/episodes", json={"group_id": "g"}, headers=admin, timeout=10
        ).json()
        assert created["base_url"].startswith(base)  # CAPTURE_PROXY_PUBLIC_URL
        reply = httpx.post(
            f"{created['base_url']}/chat/completions",
            json={"model": "anything", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 8},
            headers={"authorization": f"Bearer {created['api_key']}"},
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        closed = httpx.post(
            f"{base}/episodes/{created['episode_id']}/close", json={"reward": 1}, headers=admin
        )
        assert closed.status_code == 200

        # compose: reconstruct (follows the store)
        command = [here.get(a, a) for a in services["reconstruct"]["command"]]
        out = tmp_path / "rows"
        command[command.index("--out") + 1] = str(out)
        job = subprocess.Popen(
            [*entry, *command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not list(out.glob("rows-*.parquet")):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job wrote no rows"
            time.sleep(0.5)
        (rows_file,) = out.glob("rows-*.parquet")
        table = pq.read_table(rows_file)
        assert (
            table.num_rows == 1 and table.column("episode_id")[0].as_py() == created["episode_id"]
        )
        assert job.poll() is None  # --follow: still running, waiting for the next episode
        os.killpg(job.pid, signal.SIGTERM)
        stdout, _ = job.communicate(timeout=30)
        assert job.returncode == 0 and '"exported_episodes": 1' in stdout
    finally:
        for process in (job, proxy):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.communicate(timeout=30)
