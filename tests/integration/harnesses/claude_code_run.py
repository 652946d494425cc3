"""Run the real Claude Code binary non-interactively against an episode (DESIGN §7).

``claude -p PROMPT --output-format json --model tiny`` with ``ANTHROPIC_BASE_URL`` = the episode
URL without ``/v1``; throwaway HOME and workspace; telemetry, auto-update and nonessential
traffic off, and every outbound route other than loopback closed, so the only server it reaches
is the capture proxy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
CLAUDE_BIN = Path(
    os.environ.get("CAPTURE_CLAUDE_CODE_BIN", REPO / ".venv/claude-code/node_modules/.bin/claude")
)
DEAD = "http://127.0.0.1:9"  # nothing listens there: outbound attempts fail at once


def anthropic_base(base_url: str) -> str:
    """Claude Code appends ``/v1/messages`` itself: the episode URL without ``/v1``."""
    return base_url.removesuffix("/").removesuffix("/v1")


def run_claude_code(
    base_url: str,
    prompt: str,
    tmp: Path,
    *,
    allowed_tools: str = "Bash Agent",
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 240,
) -> dict[str, Any]:
    """``claude -p``; returns its JSON result. A missing binary fails loudly."""
    assert CLAUDE_BIN.exists(), f"{CLAUDE_BIN} missing: run scripts/install-env.sh"
    home, workspace = tmp / "home", tmp / "workspace"
    home.mkdir(exist_ok=True)
    workspace.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": anthropic_base(base_url),
        "ANTHROPIC_API_KEY": "episode-key",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "HTTP_PROXY": DEAD,
        "HTTPS_PROXY": DEAD,
        "NO_PROXY": "127.0.0.1,localhost",
        **(extra_env or {}),
    }
    done = subprocess.run(
        [
            str(CLAUDE_BIN),
            "-p",
            prompt,
            "--output-format",
            "json",
            "--model",
            "tiny",
            "--allowedTools",
            allowed_tools,
            *extra_args,
        ],
        capture_output=True,
        text=True,
        cwd=workspace,
        env=env,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (
        f"claude exited {done.returncode}: {done.stdout[-3000:]} {done.stderr[-3000:]}"
    )
    result: dict[str, Any] = json.loads(done.stdout)
    assert result.get("is_error") is False, result
    return result
