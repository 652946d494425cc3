"""``GET /episodes/{episode_id}/view``: the episode viewer's page (capture_proxy/viewer.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from capture_proxy.api.deps import StoreDep
from capture_proxy.viewer import episode_view, render_page

router = APIRouter(tags=["viewer"])


@router.get("/episodes/{episode_id}/view", response_class=HTMLResponse)
async def view_episode(episode_id: str, store: StoreDep) -> HTMLResponse:
    """The episode as an HTML page: agents as lanes on a time axis, calls and parent links,
    roles, accounting classes, fallback reasons, and each row's owned and masked tokens."""
    bundle = await store.bundle(episode_id)
    # Reconstruction is CPU work: off the event loop, so the capture path keeps serving.
    page = await asyncio.to_thread(lambda: render_page(episode_view(bundle)))
    return HTMLResponse(page)
