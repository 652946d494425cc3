"""Store queries of the reconstruction job: which closed episodes still need exporting, and the
one transaction that records an export file and claims its episodes (``Store.exports``)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from capture_proxy.store.models import Episode, Export


class Rollback(Exception):
    """Rolls a transaction back from inside ``sessionmaker.begin()``."""


class ExportQueries:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def closed_unexported(self, limit: int = 100, skip: Sequence[str] = ()) -> list[str]:
        """Closed episodes no export has claimed yet, oldest close first."""
        async with self._sessions() as session:
            query = (
                select(Episode.episode_id)
                .where(Episode.status == "closed", Episode.export_id.is_(None))
                .order_by(Episode.closed_at, Episode.episode_id)
                .limit(limit)
            )
            if skip:
                query = query.where(Episode.episode_id.not_in(list(skip)))
            return list(await session.scalars(query))

    async def record_export(self, path: str, rows: int, episode_ids: Sequence[str]) -> int | None:
        """Record a written file and mark its episodes exported, in one transaction.

        Returns the export id, or None (recording nothing) if another job claimed one of the
        episodes first.
        """
        try:
            async with self._sessions.begin() as session:
                export = Export(path=path, rows=rows, episodes=len(episode_ids))
                session.add(export)
                await session.flush()
                result = await session.execute(
                    update(Episode)
                    .where(Episode.episode_id.in_(list(episode_ids)), Episode.export_id.is_(None))
                    .values(export_id=export.export_id)
                )
                if result.rowcount != len(episode_ids):  # type: ignore[attr-defined]
                    raise Rollback
                return export.export_id
        except Rollback:
            return None

    async def export_paths(self) -> set[str]:
        async with self._sessions() as session:
            return set(await session.scalars(select(Export.path)))
