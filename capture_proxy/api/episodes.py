"""Episode REST API: create, inspect, acknowledge calls, close, bundle.

With an admin key every route needs it (:func:`capture_proxy.api.auth.require_admin`), and
``POST /episodes`` answers the new episode's own API key, once.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from capture_contracts.drift import drift_report
from capture_contracts.vocabulary import EpisodeStatus
from capture_proxy.api.auth import auth_enabled, key_digest, new_api_key, require_admin
from capture_proxy.api.deps import ServiceDep, StoreDep, base_url_for
from capture_proxy.api.openai_schemas import ERROR_RESPONSES
from capture_proxy.api.schemas import (
    NO_NUL,
    CallIdPath,
    CallOut,
    CloseEpisode,
    CreatedEpisode,
    CreateEpisode,
    EpisodeIdPath,
    EpisodeOut,
    MarkCall,
)
from capture_proxy.closing import CloseRequest, close_episode

router = APIRouter(
    prefix="/episodes",
    tags=["episodes"],
    dependencies=[Depends(require_admin)],
    responses=ERROR_RESPONSES,
)


@router.post("", status_code=201)
async def create_episode(body: CreateEpisode, store: StoreDep, request: Request) -> CreatedEpisode:
    """Open an episode (one task attempt) in a GRPO group; `base_url` is what the harness uses."""
    api_key = new_api_key() if auth_enabled(request) else None
    info = await store.create_episode(
        body.group_id,
        body.episode_id,
        body.metadata,
        api_key_hash=None if api_key is None else key_digest(api_key),
    )
    out = EpisodeOut.of(info, base_url_for(request, info.episode_id))
    return CreatedEpisode(**out.model_dump(), api_key=api_key)


@router.get("")
async def list_episodes(
    store: StoreDep,
    request: Request,
    status: EpisodeStatus | None = None,
    group_id: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
) -> list[EpisodeOut]:
    """Episodes, oldest first, optionally of one status or one group."""
    infos = await store.list_episodes(status=status, group_id=group_id)
    return [EpisodeOut.of(i, base_url_for(request, i.episode_id)) for i in infos]


@router.get("/{episode_id}")
async def get_episode(episode_id: EpisodeIdPath, store: StoreDep, request: Request) -> EpisodeOut:
    """One episode: status, reward, calls by state, and the drift report of its chat calls."""
    out = EpisodeOut.of(await store.get_episode(episode_id), base_url_for(request, episode_id))
    out.continuation = drift_report(await store.drift(episode_id))
    return out


@router.get("/{episode_id}/calls")
async def list_calls(episode_id: EpisodeIdPath, store: StoreDep) -> list[CallOut]:
    """The episode's calls in admission order, without their tokens."""
    return [CallOut.of(c) for c in await store.list_calls(episode_id)]


@router.get("/{episode_id}/bundle")
async def get_bundle(episode_id: EpisodeIdPath, store: StoreDep) -> dict[str, Any]:
    """The episode bundle (`capture-episode/v1`, docs/formats.md): every call with its tokens."""
    return (await store.bundle(episode_id)).to_dict()


@router.patch("/{episode_id}/calls/{call_id}")
async def mark_call(
    episode_id: EpisodeIdPath, call_id: CallIdPath, body: MarkCall, store: StoreDep
) -> CallOut:
    """Mark a call `discarded` or `accepted` (DESIGN §5 rule 3), or correct its role."""
    return CallOut.of(await store.mark_call(episode_id, call_id, body.mark, body.role))


@router.post("/{episode_id}/close")
async def close(
    episode_id: EpisodeIdPath, body: CloseEpisode, service: ServiceDep, request: Request
) -> EpisodeOut:
    """Close with the episode's one reward; waits `wait_s` for calls in flight, then answers 409
    (or cancels them with `cancel_outstanding`). Closed episodes go to the reconstruction job."""
    close_request = CloseRequest(
        reward=body.reward,
        wait_s=body.wait_s,
        cancel_outstanding=body.cancel_outstanding,
        discarded_calls=tuple(body.discarded_calls),
        accepted_calls=tuple(body.accepted_calls),
    )
    info = await close_episode(service, episode_id, close_request)
    return EpisodeOut.of(info, base_url_for(request, episode_id))
