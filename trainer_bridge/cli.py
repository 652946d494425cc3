"""``capture-proxy train-step``: rows → GRPO advantages → one learner step → updated model dir.

    capture-proxy train-step --rows ROWS --model DIR --out DIR [--json] [--lr LR]
                             [--micro-batch-size N] [--normalize-std] [--max-grad-norm X]
                             [--clip-eps E] [--loss NAME]

``ROWS`` is a JSON-lines file, a Parquet file or a directory of Parquet files (docs/formats.md).
Exit codes: 0 done, 1 the rows or model cannot be trained (message on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from capture_proxy.errors import TrainerError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capture-proxy train-step", description=__doc__.split("\n")[0])
    p.add_argument("--rows", required=True, help="JSON lines, Parquet file or Parquet directory")
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--out", required=True, help="directory to write the updated model to")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward/backward")
    p.add_argument("--normalize-std", action="store_true", help="divide advantages by group std")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--loss", default="clipped_pg", help="loss variant (trainer_bridge.loss.LOSSES)")
    return p


def _print_table(stats: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="train-step", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        table.add_row(key, text)
    Console().print(table)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        print("train-step: --micro-batch-size must be positive", file=sys.stderr)
        return 2

    # Imported here: `capture-proxy --help` must not import torch.
    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.learner import Learner, LearnerConfig
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.rows_io import read_rows

    config = LearnerConfig(
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        micro_batch_size=args.micro_batch_size,
        loss=LossConfig(name=args.loss, clip_eps=args.clip_eps),
    )
    started = time.perf_counter()
    try:
        rows = read_rows(args.rows)
        batch = with_advantages(collate(rows), normalize_std=args.normalize_std)
        learner = Learner.from_dir(args.model, config)
        stats = learner.step(batch).as_dict()
        learner.save(args.out)
    except TrainerError as exc:
        print(f"train-step: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    stats["seconds"] = round(time.perf_counter() - started, 3)
    stats["out"] = str(args.out)
    if args.json:
        print(json.dumps(stats))
    else:
        _print_table(stats)
    return 0
