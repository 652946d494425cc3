"""Dependency aliases for thin route handlers (async: FastAPI runs sync dependencies in a
thread pool, a thread hop per request)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from capture_proxy.proxy import CaptureService
from capture_proxy.store.repository import Store


async def _service(request: Request) -> CaptureService:
    service: CaptureService = request.app.state.service
    return service


async def _store(request: Request) -> Store:
    service: CaptureService = request.app.state.service
    return service.store


def base_url_for(request: Request, episode_id: str) -> str:
    public = request.app.state.service.settings.public_url
    root = public.rstrip("/") if public else str(request.base_url).rstrip("/")
    return f"{root}/episodes/{episode_id}/v1"


ServiceDep = Annotated[CaptureService, Depends(_service)]
StoreDep = Annotated[Store, Depends(_store)]
