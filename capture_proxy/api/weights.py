"""The served policy version: read it, pause the gate for a weight update, resume on a version.

A trainer that updates the engine's weights brackets the update with these (capture_proxy/
weights.py): ``POST /weights/pause`` returns once no call is in flight and holds new ones;
``POST /weights/resume`` names the new version (or takes the engine's ``/weight_info``, or the
proxy's counter + 1) and lets the held calls through. With an admin key, each route needs it.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends

from capture_proxy.api.auth import require_admin
from capture_proxy.api.deps import ServiceDep
from capture_proxy.api.openai_schemas import ERROR_RESPONSES
from capture_proxy.api.schemas import PauseWeights, ResumeWeights, WeightsOut
from capture_proxy.errors import CaptureProxyError
from capture_proxy.proxy import CaptureService
from capture_proxy.weights import version_of

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/weights",
    tags=["weights"],
    dependencies=[Depends(require_admin)],
    responses=ERROR_RESPONSES,
)


@router.get("")
async def get_weights(service: ServiceDep) -> WeightsOut:
    return WeightsOut.of(service.weights.state())


@router.post("/pause")
async def pause_weights(service: ServiceDep, body: PauseWeights | None = None) -> WeightsOut:
    timeout_s = body.timeout_s if body is not None else PauseWeights().timeout_s
    return WeightsOut.of(await service.weights.pause(timeout_s))


@router.post("/resume")
async def resume_weights(service: ServiceDep, body: ResumeWeights | None = None) -> WeightsOut:
    version = body.weight_version if body is not None else None
    if version is None:
        version = await _engine_version(service)
    return WeightsOut.of(service.weights.resume(version))


async def _engine_version(service: CaptureService) -> int | None:
    """The engine's own version when it reports an integer one (vLLM's dev-mode route)."""
    path = service.settings.weights.engine_version_path
    if path is None:
        return None
    try:
        reply = await service.upstream.get_json(path)
    except (CaptureProxyError, ValueError) as exc:  # ValueError: a body that is not JSON
        log.info("no engine weight version (%s): using the proxy's counter", exc)
        return None
    if reply.status_code >= 400 or not isinstance(reply.body, dict):
        return None
    found = version_of(reply.body.get("weight_version"))
    if found is not None and found < service.weights.version:
        return None  # an engine restarted on its default: keep counting
    return found
