"""Figures of ``capture-proxy train`` runs for docs/benchmarks.md and the README's curve.

    .venv/bin/python benchmarks/train_figures.py RUN_DIR... [--png docs/reward_curve.png]

Each RUN_DIR is a finished ``--out`` directory. Prints one markdown table row per run (reward of
the first and last 5 iterations, the margin, minutes per run from the phase timings + engine
start-up as logged, iteration 0's mean ratio and approx KL, the largest staleness) and draws the
mean reward per iteration of every run into one PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from capture_devkit.train.report import plot_curves, read_records, summary


def row(run: Path) -> str:
    records = read_records(run)
    config = json.loads((run / "state.json").read_text())["config"]
    s = summary(records)
    seconds = sum(sum(r["seconds"].values()) for r in records)
    first = records[0]
    staleness = max(r["staleness"]["max"] for r in records)
    return (
        f"| {config['training']} | {config['seed']} | {len(records)} | {s['first_mean']:.3f} | "
        f"{s['last_mean']:.3f} | {s['last_mean'] - s['first_mean']:+.3f} | "
        f"{seconds / 60:.1f} | {first['mean_ratio']:.6f} | {first['approx_kl']:.1e} | "
        f"{staleness} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    print(
        "| training | seed | iterations | reward first 5 | reward last 5 | margin | "
        "loop minutes | it-0 mean ratio | it-0 approx KL | max staleness |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    curves = {}
    for run in args.runs:
        print(row(run))
        config = json.loads((run / "state.json").read_text())["config"]
        curves[f"{config['training']}, seed={config['seed']}"] = [
            r["reward_mean"] for r in read_records(run)
        ]
    if args.png is not None:
        plot_curves(args.png, curves, title="mean reward (uppercase share) per iteration")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
