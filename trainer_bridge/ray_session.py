"""One Ray Train run for a whole training loop: the workers stay up between steps.

``ray_learner.ray_train_step`` starts a ``TorchTrainer`` per step (≈35 s of fixed cost here: the
workers, the process group, the model). A ``RaySession`` starts it once; its train loop then
waits for commands, one queue per rank, so every rank sees every command in order::

    driver:  session.step(rows) ─▶ the same command on each rank's queue ─▶ wait for rank 0
    worker:  all rows ─▶ GRPO advantages + staleness limit (the same on every rank: GRPO needs
             whole groups) ─▶ its shard (rows[rank::world] in row_id order) ─▶ all-reduce the
             owned-token count ─▶ Learner.accumulate under DDP ─▶ clip + step ─▶ stats summed
    driver:  session.save(dir) ─▶ rank 0 writes the weights (+ optimizer state) ─▶ done

The update of a step is the one of ``ray_learner`` (same loss scaling and gradient averaging),
so it equals the one-process update. ``close()`` stops the loop and waits for the run to end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture_contracts.rows import Row
from trainer_bridge.errors import TrainerError
from trainer_bridge.learner import LearnerConfig, StepStats

COMMAND_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class SessionConfig:
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    torch_threads: int = 1
    normalize_std: bool = False
    constrained: str = "exclude"  # batch.collate's choice
    max_staleness: int | None = None
    staleness_policy: str = "drop"
    seed: int = 0
    learner: LearnerConfig = field(default_factory=LearnerConfig)


def _shard_batch(records: list[dict[str, Any]], config: dict[str, Any], version: int) -> Any:
    """Every rank: all rows → advantages and staleness limit → this rank's rows."""
    import ray.train

    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.rows_io import rows_from_records
    from trainer_bridge.staleness import limit_staleness, staleness_stats

    session: SessionConfig = config["session"]
    batch = collate(list(rows_from_records(records)), constrained=session.constrained)  # type: ignore[arg-type]
    batch = with_advantages(batch, normalize_std=session.normalize_std)
    stale = staleness_stats(batch, version, session.max_staleness)
    batch = limit_staleness(
        batch,
        version,
        session.max_staleness,
        session.staleness_policy,  # type: ignore[arg-type]
    )
    context = ray.train.get_context()
    mine = list(range(context.get_world_rank(), batch.num_rows, context.get_world_size()))
    return (batch.select(mine) if mine else None), batch, stale


def _step(learner: Any, records: list[dict[str, Any]], config: dict[str, Any], version: int) -> Any:
    import time

    import ray.train
    import torch
    import torch.distributed as dist

    world = ray.train.get_context().get_world_size()
    shard, whole, stale = _shard_batch(records, config, version)
    num_tokens = whole.owned_tokens
    if num_tokens == 0:
        raise TrainerError("the rows own no trainable tokens", param="loss_mask")
    started = time.perf_counter()
    learner.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(6, dtype=torch.float64)  # loss, clip, kl, ratio, micro-batches, computed
    if shard is not None:
        acc = learner.accumulate(shard, num_tokens=num_tokens, loss_scale=float(world))
        sums = torch.tensor(
            [
                acc.loss,
                acc.clip_fraction,
                acc.approx_kl,
                acc.mean_ratio,
                acc.micro_batches,
                acc.computed_tokens,
            ],
            dtype=torch.float64,
        )
    elif learner.manual_sync:
        learner.all_reduce_gradients()
    else:  # an empty shard still takes part in DDP's all-reduce
        dummy = torch.zeros((1, 1), dtype=torch.long, device=learner.device)
        (learner.module(input_ids=dummy, use_cache=False).logits.sum() * 0.0).backward()
    grad_norm = learner.apply_gradients()
    dist.all_reduce(sums)
    stats = StepStats(
        loss=float(sums[0]),
        grad_norm=grad_norm,
        clip_fraction=float(sums[1]),
        approx_kl=float(sums[2]),
        mean_ratio=float(sums[3]),
        owned_tokens=num_tokens,
        rows=whole.num_rows,
        episodes=whole.num_episodes,
        micro_batches=int(sums[4]),
        lr=learner.config.lr,
        shard_rows=tuple(len(range(r, whole.num_rows, world)) for r in range(world)),
        packing=learner.config.packing,
        row_tokens=whole.row_tokens,
        computed_tokens=int(sums[5]),
        step_seconds=time.perf_counter() - started,
        constrained_tokens=whole.constrained_tokens,
    )
    return {**stats.as_dict(), "staleness": stale.as_dict()}


def _session_loop(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker until the driver sends ``stop``."""
    import ray.train
    import ray.train.torch
    import torch

    from trainer_bridge.learner import Learner

    session: SessionConfig = config["session"]
    torch.manual_seed(session.seed)
    torch.set_num_threads(session.torch_threads)
    rank = ray.train.get_context().get_world_rank()
    learner = Learner.from_dir(config["model_dir"], session.learner)
    learner.source_dir = Path(config["tokenizer_dir"])
    learner.load_optimizer(config["model_dir"])
    learner.module = ray.train.torch.prepare_model(learner.model, parallel_strategy="ddp")
    commands = config["commands"][rank]
    results = config["results"]
    while True:
        command = commands.get(timeout=COMMAND_TIMEOUT_S)
        op = command["op"]
        if op == "stop":
            return
        try:
            if op == "step":
                reply: dict[str, Any] = _step(
                    learner, command["records"], config, command["version"]
                )
            elif op == "save":
                reply = {}
                if rank == 0:
                    learner.save(command["out"], optimizer=True)
            else:
                raise TrainerError(f"unknown session command {op!r}")
        except Exception as exc:  # reported to the driver, which stops the session
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if rank == 0 or "error" in reply:
            results.put({"rank": rank, "op": op, **reply})


class RaySession:
    """A running Ray Train run (N workers, gloo) that takes steps and saves on command."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path, config: SessionConfig) -> None:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        from ray.util.queue import Queue

        if not ray.is_initialized():
            ray.init(
                num_cpus=max(2, int(config.num_workers * config.cpus_per_worker) + 1),
                include_dashboard=False,
                log_to_driver=False,
            )
        self.config = config
        self._commands = [Queue() for _ in range(config.num_workers)]
        self._results = Queue()
        self._trainer = TorchTrainer(
            _session_loop,
            train_loop_config={
                "model_dir": str(Path(model_dir).resolve()),
                "tokenizer_dir": str(Path(tokenizer_dir).resolve()),
                "session": config,
                "commands": self._commands,
                "results": self._results,
            },
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=config.num_workers,
                use_gpu=False,
                resources_per_worker={"CPU": config.cpus_per_worker},
            ),
            run_config=RunConfig(name="train-session"),
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            result = self._trainer.fit()
            if result.error is not None:
                self._error = result.error
        except BaseException as exc:  # the driver reads it at its next command
            self._error = exc

    def _command(self, command: dict[str, Any]) -> dict[str, Any]:
        for queue in self._commands:
            queue.put(command)
        while True:
            if self._error is not None:
                raise TrainerError(f"the Ray Train session ended: {self._error}")
            try:
                reply: dict[str, Any] = self._results.get(timeout=1.0)
            except Exception:  # ray.util.queue.Empty: keep watching the run
                if not self._thread.is_alive() and self._error is None:
                    raise TrainerError("the Ray Train session ended") from None
                continue
            if "error" in reply:
                raise TrainerError(f"Ray worker {reply['rank']}: {reply['error']}")
            return reply

    def step(self, rows: Sequence[Row], version: int) -> dict[str, Any]:
        """One update on all rows (GRPO over them; staleness against ``version``)."""
        return self._command(
            {"op": "step", "records": [r.to_dict() for r in rows], "version": version}
        )

    def save(self, out_dir: str | Path) -> Path:
        self._command({"op": "save", "out": str(out_dir)})
        return Path(out_dir)

    def close(self) -> None:
        if self._thread.is_alive():
            for queue in self._commands:
                queue.put({"op": "stop"})
            self._thread.join(timeout=120)
