"""``capture-proxy train-step``: rows → GRPO advantages → one learner step → updated model dir.

    capture-proxy train-step --rows ROWS --model DIR --out DIR [--json] [--lr LR]
                             [--micro-batch-size N] [--normalize-std] [--max-grad-norm X]
                             [--clip-eps E] [--loss NAME] [--optimizer NAME] [--workers N]
                             [--packing tree|padded]

``ROWS`` is a JSON-lines file, a Parquet file or a directory of Parquet files (docs/formats.md).
With ``--workers N`` the step runs on N Ray Train workers (``ray_learner``; Parquet rows only) on
the Ray cluster named by ``RAY_ADDRESS``, else on a local one. ``--packing tree`` (default)
computes each distinct token prefix of the rows once (``trainer_bridge.packing``); ``padded``
computes every row's every token. Same loss and gradient; ``--json`` reports ``row_tokens``,
``computed_tokens`` and ``step_seconds`` (forward, backward and optimizer step).
Exit codes: 0 done, 1 the rows or model cannot be trained (message on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from trainer_bridge.errors import TrainerError

if TYPE_CHECKING:
    from capture_contracts.rows import Row


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
    p.add_argument("--optimizer", default="adamw", help="adamw or sgd (learner.OPTIMIZERS)")
    p.add_argument("--workers", type=int, default=None, help="run on N Ray Train workers")
    p.add_argument(
        "--packing", default="tree", help="tree or padded (trainer_bridge.packing.PACKINGS)"
    )
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


def group_warnings(rows: Iterable[Row]) -> list[str]:
    """Groups that carry no learning signal (legal, but probably not what was meant).

    A GRPO advantage is the episode's reward minus its group's mean (DESIGN §6): a group of one
    episode, or one whose rewards are all equal, has advantage 0 everywhere, so its rows add
    nothing to the loss or the gradient.
    """
    groups: dict[str, dict[str, float | None]] = defaultdict(dict)
    row_counts: Counter[str] = Counter()
    for row in rows:
        groups[row.group_id][row.episode_id] = row.reward
        row_counts[row.group_id] += 1
    out = []
    for group_id, rewards in sorted(groups.items()):
        rows_text = f"its {row_counts[group_id]} rows add no gradient"
        if len(rewards) == 1:
            (episode_id,) = rewards
            out.append(
                f"group {group_id!r} has one episode ({episode_id!r}): its GRPO advantage is 0 "
                f"(the reward minus the mean of itself), so {rows_text}; put several attempts "
                "at the same task in one group"
            )
        elif len(set(rewards.values())) == 1:
            (reward,) = set(rewards.values())
            out.append(
                f"group {group_id!r}: all {len(rewards)} episodes have reward {reward!r}, so "
                f"every advantage is 0 and {rows_text}"
            )
    if out and len(out) == len(groups):
        out.append("no group carries a learning signal: the loss of this step is 0")
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for name in ("micro_batch_size", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"train-step: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2

    # Imported here: `capture-proxy --help` must not import torch.
    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.learner import Learner, LearnerConfig
    from trainer_bridge.loss import LossConfig
    from trainer_bridge.rows_io import read_rows

    config = LearnerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        micro_batch_size=args.micro_batch_size,
        packing=args.packing,
        loss=LossConfig(name=args.loss, clip_eps=args.clip_eps),
    )
    started = time.perf_counter()
    try:
        for warning in group_warnings(read_rows(args.rows)):
            print(f"train-step: warning: {warning}", file=sys.stderr)
        if args.workers is not None:
            from trainer_bridge.ray_learner import RayStepConfig, ray_train_step

            ray_config = RayStepConfig(
                num_workers=args.workers, normalize_std=args.normalize_std, learner=config
            )
            stats = ray_train_step(args.rows, args.model, args.out, ray_config).as_dict()
        else:
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
