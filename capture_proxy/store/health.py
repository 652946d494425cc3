"""The store's operational queries: is it reachable, how many episodes are in each status.

A component of :class:`~capture_proxy.store.repository.Store` (``store.health``), like the job's
``exports``: ``/readyz`` pings, ``/metrics`` reads the episode gauge at scrape time.
"""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from capture_proxy.errors import StoreError
from capture_proxy.store.models import Episode


class HealthQueries:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def ping(self) -> None:
        """One round trip to the database and its schema; :class:`StoreError` if it fails."""
        try:
            async with self._sessions() as session:
                await session.execute(text("SELECT 1"))
                await session.execute(select(Episode.episode_id).limit(1))
        except (SQLAlchemyError, OSError) as exc:
            raise StoreError(f"store unreachable: {type(exc).__name__}: {exc}") from exc

    async def episode_counts(self) -> dict[str, int]:
        """Episodes by status, in the whole store (every proxy process sees the same numbers)."""
        try:
            async with self._sessions() as session:
                query = select(Episode.status, func.count()).group_by(Episode.status)
                return {str(status): int(n) for status, n in (await session.execute(query)).all()}
        except (SQLAlchemyError, OSError) as exc:
            raise StoreError(f"store unreachable: {type(exc).__name__}: {exc}") from exc
