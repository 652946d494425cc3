"""The wheel installs into a fresh venv without extras and runs from any directory (issue 10).

Builds the project's wheel, installs it (its dependencies from the package index, no extras) into
a new virtualenv, then, from a directory outside the checkout: ``db upgrade`` creates the store
from the migrations inside the wheel, ``serve`` answers, an episode is created over REST, and the
dev kit's ``demo`` fails with one line naming the extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from capture_devkit.engine import free_port
from capture_proxy.store.db import alembic_config

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel and its required dependencies; returns its bin/."""
    work = tmp_path_factory.mktemp("wheel")
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-w", work / "dist", ROOT, cwd=work,
    )  # fmt: skip
    (wheel,) = (work / "dist").glob("capture_proxy-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", work / "venv", cwd=work)
    pip = [work / "venv" / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    _run(*pip, "install", "-q", wheel, cwd=work)
    return work / "venv" / "bin"


def test_wheel_carries_the_migrations_and_no_extras_are_installed(installed: Path) -> None:
    code = (
        "import importlib.util, capture_proxy.store.db as db;"
        "print(sorted(p.name for p in (db.MIGRATIONS_DIR / 'versions').glob('0*.py')));"
        "print([m for m in ('torch', 'openai', 'vllm', 'ray', 'transformers')"
        " if importlib.util.find_spec(m)])"
    )
    out = _run(installed / "python", "-c", code, cwd=installed).splitlines()
    assert out[0].startswith("['0001_initial_schema.py'") and "0003" in out[0]
    assert out[1] == "[]"


def test_db_upgrade_and_serve_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'store' / 'capture.db'}"
    (tmp_path / "store").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPTURE_PROXY_")}
    env.pop("PYTHONPATH", None)
    out = _run(installed / "capture-proxy", "db", "upgrade", "--db", url, cwd=tmp_path, env=env)
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert f"at revision {head}" in out
    port = free_port()
    server = subprocess.Popen(
        [installed / "capture-proxy", "serve", "--port", str(port), "--db", url],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.communicate()[0]
            assert time.monotonic() < deadline, "serve did not become healthy in 60 s"
            time.sleep(0.3)
        created = httpx.post(f"{base}/episodes", json={"group_id": "g"}, timeout=10)
        assert created.status_code == 201
        episode = created.json()["episode_id"]
        assert httpx.get(f"{base}/episodes/{episode}", timeout=10).json()["status"] == "open"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_dev_kit_commands_name_the_extra_they_need(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [installed / "capture-proxy", "demo", "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'capture-proxy[demo]'" in lines[0]
