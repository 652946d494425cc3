"""Run the real OpenCode binary non-interactively against an episode (DESIGN §7).

Throwaway HOME and workspace; every outbound route other than loopback is closed (a dead
loopback proxy and npm registry), so the only server OpenCode reaches is the capture proxy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
OPENCODE_BIN = Path(
    os.environ.get("CAPTURE_OPENCODE_BIN", REPO / ".venv/opencode/node_modules/.bin/opencode")
)
DEAD = "http://127.0.0.1:9"  # nothing listens there: outbound attempts fail at once
DISABLE = (
    "AUTOUPDATE",
    "MODELS_FETCH",
    "LSP_DOWNLOAD",
    "SHARE",
    "DEFAULT_PLUGINS",
    "CLAUDE_CODE",
    "EXTERNAL_SKILLS",
    "PROJECT_CONFIG",
)


def provider_config(
    models: dict[str, dict[str, Any]], agents: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config that points OpenCode at an episode (see docs/harnesses/opencode.md)."""
    return {
        "model": "capture/tiny",
        "small_model": "capture/tiny",
        "permission": {"bash": "allow", "edit": "allow"},
        "provider": {
            "capture": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Capture proxy",
                "options": {"baseURL": "{env:CAPTURE_BASE_URL}", "apiKey": "{env:CAPTURE_API_KEY}"},
                "models": models,
            }
        },
        "agent": agents or {},
    }


def run_opencode(
    base_url: str, prompt: str, config: dict[str, Any], tmp: Path, *, timeout_s: float = 110
) -> list[dict[str, Any]]:
    """``opencode run --format json``; returns its JSON events. A missing binary fails loudly."""
    assert OPENCODE_BIN.exists(), f"{OPENCODE_BIN} missing: run scripts/install-env.sh"
    home, workspace = tmp / "home", tmp / "workspace"
    home.mkdir()
    workspace.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
        "CAPTURE_BASE_URL": base_url,
        "CAPTURE_API_KEY": "episode-key",
        "HTTP_PROXY": DEAD,
        "HTTPS_PROXY": DEAD,
        "NO_PROXY": "127.0.0.1,localhost",
        "npm_config_offline": "true",
        "npm_config_registry": f"{DEAD}/",
        **{f"OPENCODE_DISABLE_{name}": "1" for name in DISABLE},
    }
    done = subprocess.run(
        [str(OPENCODE_BIN), "run", "--format", "json", "--title", "capture test"],
        input=prompt,
        capture_output=True,
        text=True,
        cwd=workspace,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"opencode exited {done.returncode}: {done.stderr[-3000:]}"
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("type") == "error"]
    assert not errors, errors
    return events
