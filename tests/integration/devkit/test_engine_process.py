"""VLLMServer's process handling, with stand-in launchers instead of vLLM (fast, no engine).

``VLLMServer(python=...)`` runs ``<python> -m <launcher> --model … --port N …``; each stand-in below
is an executable script that reads the port from those arguments and behaves like one failure mode.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest

from capture_devkit.engine import EngineError, VLLMServer

HEALTHY = """
import http.server, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[sys.argv.index("--model") + 1] + "/child.pid", "w").write(str(child.pid))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
DIES = """
import sys
print("boom: cannot load model", file=sys.stderr)
sys.exit(3)
"""
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[sys.argv.index("--model") + 1] + "/child.pid", "w").write(str(child.pid))
print("never healthy", flush=True)
time.sleep(600)
"""


def _launcher(tmp_path: Path, body: str) -> str:
    script = tmp_path / "launcher.py"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for init to reap it counts as gone
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_start_waits_for_health_and_stop_kills_the_group(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, python=_launcher(tmp_path, HEALTHY), served_model_name="m")
    with server:
        assert server.running and server.startup_s is not None
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert server.base_url == f"http://127.0.0.1:{server.port}"
        assert server.model_dir == tmp_path.resolve() and server.served_model_name == "m"
        leader = server.process.pid if server.process else -1
        child = int((tmp_path / "child.pid").read_text())
        assert os.getpgid(child) == leader != os.getpgid(0)  # its own process group
    assert not server.running
    assert _wait_gone(leader) and _wait_gone(child)


def test_command_carries_engine_flags_and_extra_args(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, port=1234, extra_args=["--enable-scale-out"])
    command = server.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    for flag in ["--enforce-eager", "--enable-auto-tool-choice", "--enable-scale-out"]:
        assert flag in command
    assert command[command.index("--dtype") + 1] == "float32"
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert command[command.index("--port") + 1] == "1234"
    env = server.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_exit_during_startup_raises_with_log_tail(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, python=_launcher(tmp_path, DIES))
    with pytest.raises(EngineError, match="status 3") as info:
        server.start()
    assert "boom: cannot load model" in info.value.message
    assert not server.running


def test_timeout_raises_and_sigkills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    server = VLLMServer(
        tmp_path, python=_launcher(tmp_path, STUBBORN), startup_timeout_s=3, stop_grace_s=0.5
    )
    with pytest.raises(EngineError, match="not healthy after 3 s") as info:
        server.start()
    assert "never healthy" in info.value.message
    leader_log = server.log_tail()
    assert "never healthy" in leader_log
    child = int((tmp_path / "child.pid").read_text())
    assert _wait_gone(child)  # the leader ignored SIGTERM; SIGKILL ended the whole group
