"""The learner step beyond one process: Ray Data reads the rows, Ray Train runs the workers.

    driver:  ray.data.read_parquet(rows) ─▶ episode table ─▶ GRPO advantages (grpo.py)
             ─▶ map_batches adds an ``advantage`` column ─▶ materialise
             ─▶ TorchTrainer(N workers, gloo), every row to exactly one worker
    worker:  its shard ─▶ TrainBatch ─▶ all-reduce the owned-token count (global N)
             ─▶ Learner.accumulate(num_tokens=N) under DDP ─▶ clip + optimizer step
             ─▶ rank 0 reports the saved model as a Ray checkpoint ─▶ driver copies it to out_dir

Why the N-worker update equals the 1-worker update: every token's loss is divided by the same
global owned-token count, so the shard losses add up to the full-batch loss; DDP *averages*
gradients over ranks, so each worker back-propagates its loss times the world size and the
all-reduced gradient is the full-batch gradient. Every rank then clips the same gradient and
takes the same step. A rank whose shard is empty back-propagates a zero loss (DDP needs every
rank in every all-reduce).

GRPO needs whole groups, so advantages are computed once on the driver from the
``(episode_id, group_id, reward)`` columns (one small table) and travel with the rows.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capture_contracts.rows import ROW_COLUMNS
from trainer_bridge.errors import TrainerError
from trainer_bridge.learner import LearnerConfig, StepStats

if TYPE_CHECKING:
    import ray.data

    from trainer_bridge.batch import TrainBatch

ADVANTAGE_COLUMN = "advantage"
ROWS_DATASET = "rows"


@dataclass(frozen=True, slots=True)
class RayStepConfig:
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    torch_threads: int = 1  # per worker
    normalize_std: bool = False
    storage_path: str | None = None  # Ray Train run directory; a temporary one if None
    learner: LearnerConfig = field(default_factory=LearnerConfig)


def read_rows_dataset(path: str | Path) -> ray.data.Dataset:
    """The job's Parquet rows (a file or a directory) as a Ray dataset."""
    import ray.data

    path = Path(path)
    if not path.exists():
        raise TrainerError(f"{path}: no such file or directory", param="rows")
    return ray.data.read_parquet(str(path), columns=list(ROW_COLUMNS))


def with_advantage_column(
    ds: ray.data.Dataset, *, normalize_std: bool = False
) -> tuple[ray.data.Dataset, int]:
    """Add each row's GRPO episode advantage as a column; also return the number of episodes."""
    from trainer_bridge.grpo import episode_advantages, episode_rewards

    table = ds.select_columns(["episode_id", "group_id", "reward"]).take_all()
    episodes = episode_rewards((r["episode_id"], r["group_id"], r["reward"]) for r in table)
    advantages = episode_advantages(episodes, normalize_std=normalize_std)

    def add(batch: Any) -> Any:
        import pyarrow as pa

        values = [advantages[e] for e in batch.column("episode_id").to_pylist()]
        return batch.append_column(ADVANTAGE_COLUMN, pa.array(values, type=pa.float64()))

    return ds.map_batches(add, batch_format="pyarrow"), len(episodes)


def shard_batch(records: Sequence[Mapping[str, Any]]) -> TrainBatch:
    """A worker's records (row columns + ``advantage``) → a TrainBatch with advantages."""
    import torch

    from trainer_bridge.batch import collate
    from trainer_bridge.rows_io import rows_from_records

    batch = collate(list(rows_from_records(records)))
    per_row = {str(r["row_id"]): float(r[ADVANTAGE_COLUMN]) for r in records}
    advantage = torch.tensor([per_row[i] for i in batch.row_ids], dtype=torch.float32)  # [B]
    return dataclasses.replace(batch, advantages=advantage[:, None] * batch.loss_mask)  # [B, T]


def _exact_split_config() -> Any:
    """Ray Train's data config, but every row reaches exactly one worker.

    The default ``DataConfig`` splits with ``streaming_split(n, equal=True)``, which drops rows
    to make the shards equal: a silent change of the update. This split keeps every row (shards
    may differ by a few rows, or be empty; the worker loop handles both).
    """
    from ray.train import DataConfig

    class ExactSplit(DataConfig):
        def configure(
            self,
            datasets: dict[str, ray.data.Dataset],
            world_size: int,
            worker_handles: Any,
            worker_node_ids: Any,
            **kwargs: Any,
        ) -> list[dict[str, Any]]:
            output: list[dict[str, Any]] = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                for rank, split in enumerate(ds.streaming_split(world_size, equal=False)):
                    output[rank][name] = split
            return output

    return ExactSplit()


def _train_loop(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (a process with a gloo process group)."""
    import time

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from trainer_bridge.learner import Learner

    torch.set_num_threads(config["torch_threads"])
    learner_config: LearnerConfig = config["learner"]
    world_size = ray.train.get_context().get_world_size()
    rank = ray.train.get_context().get_world_rank()

    shard = ray.train.get_dataset_shard(ROWS_DATASET)
    records: list[dict[str, Any]] = []
    for part in shard.iter_batches(batch_format="pyarrow", batch_size=None):
        records.extend(part.to_pylist())
    batch = shard_batch(records) if records else None

    learner = Learner.from_dir(config["model_dir"], learner_config)
    learner.module = ray.train.torch.prepare_model(learner.model, parallel_strategy="ddp")
    learner.optimizer.zero_grad(set_to_none=True)

    local = torch.tensor(
        [batch.owned_tokens if batch else 0, batch.num_rows if batch else 0], dtype=torch.int64
    )
    per_rank = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(per_rank, local)
    num_tokens = sum(int(c[0]) for c in per_rank)
    shard_rows = tuple(int(c[1]) for c in per_rank)
    if num_tokens == 0:
        raise TrainerError("the rows own no tokens: nothing to train", param="loss_mask")

    started = time.perf_counter()
    # loss, clip, kl, ratio, micro-batches, row tokens, computed tokens, constrained tokens
    sums = torch.zeros(8, dtype=torch.float64)
    if batch is not None:
        acc = learner.accumulate(batch, num_tokens=num_tokens, loss_scale=float(world_size))
        sums = torch.tensor(
            [
                acc.loss,
                acc.clip_fraction,
                acc.approx_kl,
                acc.mean_ratio,
                acc.micro_batches,
                batch.row_tokens,
                acc.computed_tokens,
                batch.constrained_tokens,
            ],
            dtype=torch.float64,
        )
    elif learner.manual_sync:  # an empty shard still takes part in the all-reduce, with zeros
        learner.all_reduce_gradients()
    else:  # an empty shard still takes part in DDP's gradient all-reduce, with zeros
        dummy = torch.zeros((1, 1), dtype=torch.long, device=learner.device)
        (learner.module(input_ids=dummy, use_cache=False).logits.sum() * 0.0).backward()
    grad_norm = learner.apply_gradients()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)

    stats = StepStats(
        loss=float(sums[0]),
        grad_norm=grad_norm,
        clip_fraction=float(sums[1]),
        approx_kl=float(sums[2]),
        mean_ratio=float(sums[3]),
        owned_tokens=num_tokens,
        rows=sum(shard_rows),
        episodes=config["episodes"],
        micro_batches=int(sums[4]),
        lr=learner_config.lr,
        shard_rows=shard_rows,
        packing=learner_config.packing,
        row_tokens=int(sums[5]),
        computed_tokens=int(sums[6]),
        step_seconds=float(seconds[0]),
        constrained_tokens=int(sums[7]),
    )
    if rank != 0:
        ray.train.report(stats.as_dict())
        return
    # Rank 0 hands the updated model over as a Ray checkpoint: Ray copies it to the run's storage,
    # which the driver reads whichever node this worker ran on.
    with tempfile.TemporaryDirectory(prefix="learner-") as tmp:
        learner.save(tmp)
        ray.train.report(stats.as_dict(), checkpoint=ray.train.Checkpoint.from_directory(tmp))


def ray_train_step(
    rows_path: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    config: RayStepConfig | None = None,
) -> StepStats:
    """One GRPO learner step on ``config.num_workers`` Ray Train workers; writes ``out_dir``.

    Uses the Ray cluster already initialised by the caller, else starts a local one.
    """
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = config or RayStepConfig()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)

    # Materialised on the driver before the workers start: the rows of one step must fit in
    # the workers anyway, and Ray Data's tasks then never wait for CPUs the workers hold.
    rows = read_rows_dataset(rows_path).materialize()
    ds, num_episodes = with_advantage_column(rows, normalize_std=config.normalize_std)
    # At least one block per worker: the split hands out whole blocks, evenly by rows.
    ds = ds.repartition(config.num_workers).materialize()
    with tempfile.TemporaryDirectory(prefix="ray-train-") as scratch:
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={
                "model_dir": str(Path(model_dir).resolve()),
                "learner": config.learner,
                "torch_threads": config.torch_threads,
                "episodes": num_episodes,
            },
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=config.num_workers,
                use_gpu=False,
                resources_per_worker={"CPU": config.cpus_per_worker},
            ),
            run_config=RunConfig(name="train-step", storage_path=config.storage_path or scratch),
            datasets={ROWS_DATASET: ds},
            dataset_config=_exact_split_config(),
        )
        result = trainer.fit()
        if result.error is not None:
            raise TrainerError(f"Ray Train step failed: {result.error}") from result.error
        if result.checkpoint is None or not result.metrics:
            raise TrainerError("Ray Train step reported no model checkpoint")
        result.checkpoint.to_directory(str(out_dir))
    metrics = dict(result.metrics)
    metrics["shard_rows"] = tuple(metrics["shard_rows"])
    return StepStats(**{f.name: metrics[f.name] for f in dataclasses.fields(StepStats)})
