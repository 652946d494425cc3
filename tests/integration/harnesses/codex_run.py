"""Run the real Codex CLI non-interactively against an episode (DESIGN §7).

``codex exec`` with a custom model provider whose ``base_url`` is the episode URL and
``wire_api = "responses"``; throwaway HOME/CODEX_HOME and workspace; every outbound route other
than loopback closed, so the only server it reaches is the capture proxy. Commands run without
Codex's sandbox (``--dangerously-bypass-approvals-and-sandbox``: the test's workspace is a
throwaway directory, and the container has no user namespaces for bubblewrap).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CODEX_BIN = Path(os.environ.get("CAPTURE_CODEX_BIN", REPO / ".venv/codex/node_modules/.bin/codex"))
DEAD = "http://127.0.0.1:9"  # nothing listens there: outbound attempts fail at once


def provider_args(base_url: str, model: str = "tiny") -> list[str]:
    """The ``-c`` overrides that point Codex at an episode (see docs/harnesses/codex.md)."""
    provider = (
        f'{{name="capture", base_url="{base_url}", env_key="CAPTURE_API_KEY", '
        f'wire_api="responses"}}'
    )
    return [
        "-c",
        'model_provider="capture"',
        "-c",
        f'model="{model}"',
        "-c",
        f"model_providers.capture={provider}",
    ]


def run_codex(
    base_url: str,
    prompt: str,
    tmp: Path,
    *,
    config: tuple[str, ...] = (),
    timeout_s: float = 240,
) -> str:
    """``codex exec``; returns its last message (stdout). A missing binary fails loudly."""
    assert CODEX_BIN.exists(), f"{CODEX_BIN} missing: run scripts/install-env.sh"
    home, workspace = tmp / "home", tmp / "workspace"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    workspace.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "CAPTURE_API_KEY": "episode-key",
        "HTTP_PROXY": DEAD,
        "HTTPS_PROXY": DEAD,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    args = [str(CODEX_BIN), "exec", "--skip-git-repo-check"]
    args += ["--dangerously-bypass-approvals-and-sandbox", *provider_args(base_url)]
    for item in config:
        args += ["-c", item]
    done = subprocess.run(
        [*args, prompt],
        capture_output=True,
        text=True,
        cwd=workspace,
        env=env,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (
        f"codex exited {done.returncode}: {done.stdout[-3000:]} {done.stderr[-3000:]}"
    )
    return done.stdout
