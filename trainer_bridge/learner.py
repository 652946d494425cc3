"""The learner: a Hugging Face causal LM, one optimizer step per batch.

``Learner.step(batch)`` = ``accumulate`` (forward + backward over micro-batches, each loss divided
by the batch's global owned-token count, so accumulation sums to the full-batch gradient) then
``apply_gradients`` (clip, AdamW step). ``accumulate`` and ``apply_gradients`` are separate so the
Ray workers (``ray_learner``) can run the same code on their shards with the global count.

The model is kept in eval mode (no dropout): the learner's logprobs under unchanged weights must
be those the engine sampled with. Gradients flow as usual.

How the forward pass covers the rows is ``LearnerConfig.packing`` (``packing.PACKINGS``):
``tree`` (default) computes each distinct token prefix of a micro-batch once, ``padded`` every
row's every token; the loss is the same code on the same ``[B, T]`` logprobs either way.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer_bridge.batch import TrainBatch
from trainer_bridge.errors import TrainerError
from trainer_bridge.loss import LossConfig, policy_loss
from trainer_bridge.packing import Packed, get_packing, padded_logprobs

#: The optimizer's state next to saved weights (``Learner.save(..., optimizer=True)``).
OPTIMIZER_FILE = "optimizer.pt"
# Files besides weights and config.json that a serving engine needs from the model directory.
TOKENIZER_FILE_PATTERNS: tuple[str, ...] = (
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "generation_config.json",
)


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    optimizer: str = "adamw"  # a key of OPTIMIZERS
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    micro_batch_size: int | None = None  # rows per forward/backward; None = whole batch
    packing: str = "tree"  # a key of packing.PACKINGS: "tree" or "padded"
    loss: LossConfig = field(default_factory=LossConfig)


def _adamw(params: list[nn.Parameter], cfg: LearnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def _sgd(params: list[nn.Parameter], cfg: LearnerConfig) -> torch.optim.Optimizer:
    # Plain SGD: the update is linear in the gradient, which makes equivalence tests sharp
    # (Adam's first step and gradient clipping are both blind to the gradient's scale).
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], LearnerConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "sgd": _sgd,
}


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did. Loss-side values are global token means (sums over micro-batches)."""

    loss: float
    grad_norm: float  # total L2 norm of the gradient before clipping
    clip_fraction: float
    approx_kl: float
    mean_ratio: float
    owned_tokens: int
    rows: int
    episodes: int
    micro_batches: int
    lr: float
    shard_rows: tuple[int, ...] = ()  # rows on each data-parallel worker (one entry: no Ray)
    packing: str = "padded"
    row_tokens: int = 0  # real tokens of the rows (all ranks)
    computed_tokens: int = 0  # tokens the forward passes processed (all ranks, pads included)
    step_seconds: float = 0.0  # forward + backward + optimizer step (slowest rank)
    constrained_tokens: int = 0  # owned but grammar-constrained: kept out of the loss (batch.py)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Accumulated:
    """Running sums of one step's loss and stats (each already divided by the global count)."""

    loss: float = 0.0
    clip_fraction: float = 0.0
    approx_kl: float = 0.0
    mean_ratio: float = 0.0
    micro_batches: int = 0
    computed_tokens: int = 0


def load_causal_lm(model_dir: str | Path, *, device: str = "cpu") -> nn.Module:
    """Load a Hugging Face causal LM from a local directory in float32 (no network access)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise TrainerError(f"{path}: not a model directory (no config.json)", param="model")
    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    return model.to(device)


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]``: position t holds log π(input_ids[t] | input_ids[:t]); 0 at t = 0 and on pads."""
    return padded_logprobs(model, model, input_ids, attention_mask, attention_mask).logprobs


class Learner:
    """One policy model and its optimizer."""

    def __init__(
        self, model: nn.Module, config: LearnerConfig, *, source_dir: Path | None = None
    ) -> None:
        self.model = model
        self.model.eval()
        # What forward calls go through; a data-parallel wrapper (DDP) replaces it.
        self.module: nn.Module = model
        self.config = config
        self.source_dir = source_dir
        if config.optimizer not in OPTIMIZERS:
            known = ", ".join(sorted(OPTIMIZERS))
            raise TrainerError(f"unknown optimizer {config.optimizer!r} (known: {known})")
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = OPTIMIZERS[config.optimizer](params, config)
        self.packing = get_packing(config.packing)

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, config: LearnerConfig | None = None, *, device: str = "cpu"
    ) -> Learner:
        model = load_causal_lm(model_dir, device=device)
        return cls(model, config or LearnerConfig(), source_dir=Path(model_dir))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def token_logprobs(self, batch: TrainBatch, *, grad: bool = False) -> torch.Tensor:
        """``[B, T]`` logprobs of the batch's tokens under the current weights (0 on pads)."""
        return self._packed(batch, batch.attention_mask, grad=grad).logprobs

    def _packed(self, batch: TrainBatch, score_mask: torch.Tensor, *, grad: bool) -> Packed:
        """Logprobs at least at ``score_mask``'s positions, by the configured packing."""
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context:
            return self.packing(
                self.model,
                self.model if self.manual_sync else self.module,
                batch.input_ids.to(self.device),
                batch.attention_mask.to(self.device),
                score_mask.to(self.device),
            )

    @property
    def manual_sync(self) -> bool:
        """Tree packing under DDP: one forward per segment, which DDP's reducer (one forward per
        backward) does not allow. The forwards then bypass the wrapper (its autograd hooks stay
        idle) and :meth:`all_reduce_gradients` averages the gradients as DDP would."""
        return self.config.packing == "tree" and getattr(self.module, "no_sync", None) is not None

    def all_reduce_gradients(self) -> None:
        import torch.distributed as dist

        world = dist.get_world_size()
        for param in self.model.parameters():  # the same order on every rank
            if not param.requires_grad:
                continue
            if param.grad is None:  # unused here: every rank must still take part
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad /= world

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.module, "no_sync", None)
        if self.manual_sync or last or no_sync is None:
            return contextlib.nullcontext()
        ctx: contextlib.AbstractContextManager[Any] = no_sync()
        return ctx

    def accumulate(
        self, batch: TrainBatch, *, num_tokens: int, loss_scale: float = 1.0
    ) -> Accumulated:
        """Forward + backward over micro-batches, adding into ``.grad``; no optimizer step.

        ``num_tokens`` is the owned-token count of the whole update (all ranks). ``loss_scale``
        multiplies what is back-propagated, not what is reported (DDP averages gradients over
        ranks, so its workers pass the world size to recover the sum).
        """
        if batch.advantages is None:
            raise TrainerError("batch has no advantages: call grpo.with_advantages first")
        acc = Accumulated()
        parts = batch.micro_batches(self.config.micro_batch_size)
        for i, part in enumerate(parts):
            assert part.advantages is not None
            with self._sync_context(last=i == len(parts) - 1):
                packed = self._packed(part, part.loss_mask, grad=True)
                loss, stats = policy_loss(
                    packed.logprobs,  # [b, t], exact on owned positions
                    part.behavior_logprobs.to(self.device),
                    part.advantages.to(self.device),
                    part.loss_mask.to(self.device),
                    num_tokens=num_tokens,
                    cfg=self.config.loss,
                )
                (loss * loss_scale).backward()
            acc.loss += float(loss.item())
            acc.clip_fraction += float(stats.clip_fraction.item())
            acc.approx_kl += float(stats.approx_kl.item())
            acc.mean_ratio += float(stats.mean_ratio.item())
            acc.micro_batches += 1
            acc.computed_tokens += packed.computed_tokens
        if self.manual_sync:
            self.all_reduce_gradients()
        return acc

    def apply_gradients(self) -> float:
        """Clip the accumulated gradient, step, clear it; return the norm before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm.item())

    def step(self, batch: TrainBatch) -> StepStats:
        """One update on the whole batch (normalised by its own owned-token count)."""
        num_tokens = batch.owned_tokens
        if num_tokens == 0:
            raise TrainerError("the batch owns no tokens: nothing to train", param="loss_mask")
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        acc = self.accumulate(batch, num_tokens=num_tokens)
        grad_norm = self.apply_gradients()
        step_seconds = time.perf_counter() - started
        return StepStats(
            loss=acc.loss,
            grad_norm=grad_norm,
            clip_fraction=acc.clip_fraction,
            approx_kl=acc.approx_kl,
            mean_ratio=acc.mean_ratio,
            owned_tokens=num_tokens,
            rows=batch.num_rows,
            episodes=batch.num_episodes,
            micro_batches=acc.micro_batches,
            lr=self.config.lr,
            shard_rows=(batch.num_rows,),
            packing=self.config.packing,
            row_tokens=batch.row_tokens,
            computed_tokens=acc.computed_tokens,
            step_seconds=step_seconds,
            constrained_tokens=batch.constrained_tokens,
        )

    def save(self, out_dir: str | Path, *, optimizer: bool = False) -> Path:
        """Write weights (safetensors) + config, and copy the tokenizer files of the source dir;
        with ``optimizer``, the optimizer's state too (``OPTIMIZER_FILE``: a run resumes there)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out))  # type: ignore[operator]
        if optimizer:
            torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)
        for src in self._tokenizer_files():
            dst = out / src.name
            if not dst.exists():
                shutil.copy2(src, dst)
        return out

    def load_optimizer(self, model_dir: str | Path) -> bool:
        """Restore the optimizer state saved next to the weights, if any; True when found."""
        path = Path(model_dir) / OPTIMIZER_FILE
        if not path.is_file():
            return False
        self.optimizer.load_state_dict(torch.load(path, weights_only=True))
        return True

    def _tokenizer_files(self) -> Iterator[Path]:
        if self.source_dir is None:
            return
        seen: set[Path] = set()
        for pattern in TOKENIZER_FILE_PATTERNS:
            for path in sorted(self.source_dir.glob(pattern)):
                if path.is_file() and path not in seen:
                    seen.add(path)
                    yield path
