"""Episode API key digests: read once per episode and kept in this process.

A digest is written with the episode (``Store.create_episode(api_key_hash=…)``) and never changes,
so a cached one can never be stale, even with several proxy processes on one store; an unknown
episode is not cached (it may be created by another process a moment later).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from capture_proxy.store.models import Episode


@dataclass(frozen=True, slots=True)
class KeyDigest:
    """What the store holds for an episode: its key's digest, or None (created open)."""

    digest: str | None


class EpisodeKeys:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], cached: int = 65536) -> None:
        self._sessions = sessions
        self._cached = cached
        self._digests: OrderedDict[str, KeyDigest] = OrderedDict()

    async def digest(self, episode_id: str) -> KeyDigest | None:
        """The episode's key digest; None when there is no such episode."""
        known = self._digests.get(episode_id)
        if known is not None:
            self._digests.move_to_end(episode_id)
            return known
        async with self._sessions() as session:
            row = (
                await session.execute(
                    select(Episode.api_key_hash).where(Episode.episode_id == episode_id)
                )
            ).first()
        if row is None:
            return None
        known = self._digests[episode_id] = KeyDigest(row[0])
        while len(self._digests) > self._cached:
            self._digests.popitem(last=False)
        return known
