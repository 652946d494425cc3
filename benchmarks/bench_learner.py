"""Learner step, tree packing vs padded, on GRPO groups of harness-like episodes.

    .venv/bin/python benchmarks/bench_learner.py [--groups 2 4 8 16] [--repeats 1]
                                                 [--padded-micro-batch 1] [--threads 2]

One episode (token counts; random ids from a fixed seed):

    parent    system prompt 7,000 + task 1,000          (the 8k both shared by the whole group)
              + turn 100 (owned) + tool result 400 + delegation 100 (owned)
              + the two workers' answers pasted in (2 × 150, masked) + turn 100 (owned)
              + tool result 400 + compaction instruction 50 + summary 300 (owned)
              → row 1 (9,750 tokens: the compaction call's row repeats the whole context)
    rewrite   system prompt 7,000 + summary 300 + turn 100 (owned) + tool 400 + turn 100 (owned)
              → row 2 (7,900 tokens)
    workers   ×2: worker system prompt 2,000 (shared by all workers) + task 100
              + turn 100 (owned) + tool result 400 + answer 150 (owned) → rows 3, 4 (2,750 each)

A group of G such episodes (different rewards) is one batch. Each (G, packing) step runs in its
own Python process, so its peak RSS is its own: ``padded`` with ``--padded-micro-batch`` rows per
forward (1 by default: no padding at all, and the padded learner's smallest memory), ``tree``
with the whole group in one micro-batch (one prefix forest). The step is one
``Learner.step`` (forward, backward, clip, AdamW) after a warm-up step on a small batch; the
best of ``--repeats`` (the machine is shared: the minimum is the least disturbed run). The model
is the project's tiny Qwen2 (``make-tiny-model``: hidden 64, 2 layers, vocab 4,096, 32,768
positions — the rows fit).

Printed side by side per G: row tokens, tokens computed by each packing, step seconds, peak
RSS, and the tree/padded ratios; the two losses agree (same loss, same gradient).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEM, TASK, WORKER_SYSTEM = 7_000, 1_000, 2_000
TURN, TOOL, DELEGATE, ANSWER, INSTRUCTION, SUMMARY, WORKER_TASK = 100, 400, 100, 150, 50, 300, 100
VOCAB = 4_000  # ids below the tiny model's added tokens


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def harness_group(group_size: int, *, seed: int = 0) -> list[Any]:
    """The rows of one GRPO group of harness-like episodes (see the module docstring)."""
    from capture_contracts.rows import Row

    shared = random.Random(seed)
    system, task = _ids(SYSTEM, shared), _ids(TASK, shared)
    worker_system, instruction = _ids(WORKER_SYSTEM, shared), _ids(INSTRUCTION, shared)
    rows: list[Row] = []

    def row(episode: int, pieces: list[tuple[list[int], bool]], reward: float) -> None:
        ids = [t for tokens, _ in pieces for t in tokens]
        mask = [int(owned) for tokens, owned in pieces for _ in tokens]
        rng = random.Random(len(rows))
        logprobs = [-8.3 + rng.uniform(-0.5, 0.5) if m else 0.0 for m in mask]
        rows.append(
            Row(
                row_id=f"ep{episode:02d}/{len(rows)}",
                episode_id=f"ep{episode:02d}",
                group_id="g",
                reward=reward,
                input_ids=tuple(ids),
                loss_mask=tuple(mask),
                behavior_logprobs=tuple(logprobs),
            )
        )

    for e in range(group_size):
        rng = random.Random(1000 + e)
        reward = float(e % 4) / 3
        workers = []
        for _ in range(2):
            w_task, w_turn, w_tool, w_answer = (
                _ids(WORKER_TASK, rng),
                _ids(TURN, rng),
                _ids(TOOL, rng),
                _ids(ANSWER, rng),
            )
            workers.append(w_answer)
            w_pieces = [(worker_system, False), (w_task, False), (w_turn, True)]
            row(e, [*w_pieces, (w_tool, False), (w_answer, True)], reward)
        summary = _ids(SUMMARY, rng)
        parent = [
            (system, False),
            (task, False),
            (_ids(TURN, rng), True),
            (_ids(TOOL, rng), False),
            (_ids(DELEGATE, rng), True),
            (workers[0] + workers[1], False),
            (_ids(TURN, rng), True),
            (_ids(TOOL, rng), False),
            (instruction, False),
            (summary, True),
        ]
        row(e, parent, reward)
        rewrite = [(system, False), (summary, False), (_ids(TURN, rng), True)]
        row(e, [*rewrite, (_ids(TOOL, rng), False), (_ids(TURN, rng), True)], reward)
    return rows


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(model_dir: str, group_size: int, packing: str, args: argparse.Namespace) -> None:
    """One (G, packing) measurement in this process; prints one JSON line."""
    import torch

    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.learner import Learner, LearnerConfig

    torch.set_num_threads(args.threads)
    if args.tree_attention == "chunked":
        from trainer_bridge import tree_attention

        tree_attention.FORCE_CHUNKED = True
    micro = args.padded_micro_batch if packing == "padded" else None
    learner = Learner.from_dir(
        model_dir, LearnerConfig(lr=1e-4, packing=packing, micro_batch_size=micro)
    )
    warmup = harness_group(1, seed=1)
    learner.step(with_advantages(collate([r for r in warmup if len(r.input_ids) < 3000])))
    batch = with_advantages(collate(harness_group(group_size)))
    base_rss = _peak_rss_mb()
    times, losses = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        stats = learner.step(batch)
        times.append(time.perf_counter() - started)
        losses.append(stats.loss)
    result = {
        "group_size": group_size,
        "packing": packing,
        "rows": stats.rows,
        "row_tokens": stats.row_tokens,
        "computed_tokens": stats.computed_tokens,
        "owned_tokens": stats.owned_tokens,
        "step_seconds": min(times),
        "step_seconds_median": statistics.median(times),
        "load_average": os.getloadavg()[0],
        "loss_first_step": losses[0],
        "peak_rss_mb": _peak_rss_mb(),
        "base_rss_mb": base_rss,
    }
    print(json.dumps(result))


def _measure(model_dir: Path, group_size: int, packing: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--one", str(model_dir), str(group_size), packing]
    argv += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    argv += ["--padded-micro-batch", str(args.padded_micro_batch)]
    argv += ["--tree-attention", args.tree_attention]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _print(results: list[tuple[dict, dict]], args: argparse.Namespace) -> None:
    print(
        f"\nLearner step, padded (micro-batch {args.padded_micro_batch} rows) vs tree "
        f"(whole group, {args.tree_attention} prefix attention), {args.threads} torch threads, "
        f"best of {args.repeats}\n"
    )
    header = (
        "|  G | rows | row tokens | padded computed | tree computed | tree/row tokens "
        "| padded step (s) | tree step (s) | speedup | padded peak RSS (MB) | tree peak RSS (MB) "
        "| tree/padded RSS |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    for padded, tree in results:
        print(
            f"| {padded['group_size']:>2} | {padded['rows']:>4} | {padded['row_tokens']:>10,} "
            f"| {padded['computed_tokens']:>15,} | {tree['computed_tokens']:>13,} "
            f"| {tree['computed_tokens'] / tree['row_tokens']:>15.3f} "
            f"| {padded['step_seconds']:>15.2f} | {tree['step_seconds']:>13.2f} "
            f"| {padded['step_seconds'] / tree['step_seconds']:>6.2f}× "
            f"| {padded['peak_rss_mb']:>20,.0f} | {tree['peak_rss_mb']:>18,.0f} "
            f"| {tree['peak_rss_mb'] / padded['peak_rss_mb']:>15.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--padded-micro-batch", type=int, default=1)
    parser.add_argument(
        "--tree-attention",
        choices=["split", "chunked"],
        default="split",
        help="prefix attention of the tree (trainer_bridge.tree_attention; measurements)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "G", "PACKING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one[0], int(args.one[1]), args.one[2], args)
        return

    from capture_devkit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        results = []
        for group_size in args.groups:
            pair = tuple(_measure(model_dir, group_size, p, args) for p in ("padded", "tree"))
            print(json.dumps(pair), file=sys.stderr)
            results.append(pair)
    _print(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
