"""Transactional operations on episodes and calls.

Every state change is one short transaction. The episode-wide counter (``episodes.seq``) is
incremented with ``UPDATE … RETURNING`` inside the transaction that admits or completes a call, so
``admitted_seq``/``completed_seq`` order calls correctly across several proxy processes.
Call state changes are conditional (``WHERE status = 'admitted'``): the first terminal state wins,
so a completion racing a cancellation can never record both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from capture_contracts.bundle import (
    CallRecord,
    EpisodeBundle,
    parse_continuation,
)
from capture_contracts.drift import CallDrift
from capture_contracts.vocabulary import EpisodeStatus, FailedStatus, Mark, Role
from capture_proxy.errors import Conflict, NotFound, StoreError
from capture_proxy.store.exports import ExportQueries
from capture_proxy.store.health import HealthQueries
from capture_proxy.store.keys import EpisodeKeys
from capture_proxy.store.leases import InstanceIdentity
from capture_proxy.store.models import Call, Episode, utcnow
from capture_proxy.store.packing import (
    ids_array,
    logprobs_array,
    unpack_ids,
)
from capture_proxy.store.records import (
    Admission,
    CallAccounting,
    CallInfo,
    CompletedChatCall,
    EpisodeInfo,
    Generation,
)
from capture_proxy.store.sqlite_writer import SqliteSynchronous
from capture_proxy.store.writer import Writer


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:20]}"


def _call_info(call: Call) -> CallInfo:
    return CallInfo(
        call_id=call.call_id,
        request_id=call.request_id,
        choice_index=call.choice_index,
        endpoint=call.endpoint,
        stream=call.stream,
        agent_id=call.agent_id,
        parent_agent_id=call.parent_agent_id,
        role=call.role,
        status=call.status,  # type: ignore[arg-type]
        mark=call.mark,  # type: ignore[arg-type]
        admitted_seq=call.admitted_seq,
        completed_seq=call.completed_seq,
        finish_reason=call.finish_reason,
        error=call.error,
        model=call.model,
        prompt_tokens=call.prompt_tokens,
        completion_tokens=call.completion_tokens,
    )


class Store:
    """The proxy's and the job's only way into the database.

    The capture path's changes (admissions, completions, failures) go through the group-commit
    :class:`~capture_proxy.store.writer.Writer`; episode management and reads use ORM sessions;
    the reconstruction job's queries are ``exports``.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        sqlite_synchronous: SqliteSynchronous = "FULL",
        max_batch: int = 256,
        identity: InstanceIdentity | None = None,
        lease_s: float = 15.0,
    ) -> None:
        self._sessions = sessions
        self.exports = ExportQueries(sessions)
        self.health = HealthQueries(sessions)
        self.keys = EpisodeKeys(sessions)
        engine = sessions.kw["bind"]
        self.writer = Writer(
            engine,
            sqlite_synchronous=sqlite_synchronous,
            max_batch=max_batch,
            identity=identity,
            lease_s=lease_s,
        )

    async def aclose(self) -> None:
        """Stop the writer (what it was given is committed first)."""
        await self.writer.aclose()

    # -- episodes ---------------------------------------------------------------------------

    async def create_episode(
        self,
        group_id: str,
        episode_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        api_key_hash: str | None = None,  # access control (capture_proxy/api/auth.py)
    ) -> EpisodeInfo:
        episode_id = episode_id or new_id("ep_")
        try:
            async with self._sessions.begin() as session:
                if await session.get(Episode, episode_id) is not None:
                    raise Conflict(f"episode {episode_id!r} already exists", param="episode_id")
                session.add(
                    Episode(
                        episode_id=episode_id,
                        group_id=group_id,
                        status="open",
                        metadata_=metadata or {},
                        seq=0,
                        api_key_hash=api_key_hash,
                    )
                )
        except IntegrityError as exc:
            raise Conflict(f"episode {episode_id!r} already exists", param="episode_id") from exc
        return await self.get_episode(episode_id)

    async def get_episode(self, episode_id: str) -> EpisodeInfo:
        async with self._sessions() as session:
            episode = await self._episode(session, episode_id)
            counts = await self._accounting(session, [episode_id])
            return self._episode_info(episode, counts.get(episode_id, CallAccounting()))

    async def list_episodes(
        self, status: str | None = None, group_id: str | None = None, limit: int = 1000
    ) -> list[EpisodeInfo]:
        async with self._sessions() as session:
            query = select(Episode).order_by(Episode.created_at, Episode.episode_id).limit(limit)
            if status is not None:
                query = query.where(Episode.status == status)
            if group_id is not None:
                query = query.where(Episode.group_id == group_id)
            episodes = list((await session.scalars(query)).all())
            counts = await self._accounting(session, [e.episode_id for e in episodes])
            return [
                self._episode_info(e, counts.get(e.episode_id, CallAccounting())) for e in episodes
            ]

    @staticmethod
    def _episode_info(episode: Episode, counts: CallAccounting) -> EpisodeInfo:
        return EpisodeInfo(
            episode_id=episode.episode_id,
            group_id=episode.group_id,
            status=episode.status,  # type: ignore[arg-type]
            reward=episode.reward,
            metadata=dict(episode.metadata_ or {}),
            calls=counts,
            exported=episode.export_id is not None,
        )

    @staticmethod
    async def _episode(session: AsyncSession, episode_id: str, *, lock: bool = False) -> Episode:
        """``lock``: take the episode row's lock first (PostgreSQL), the writer's order (episode,
        then its calls), so a close marking calls never deadlocks with a batch completing one."""
        episode = await session.get(Episode, episode_id, with_for_update=lock or None)
        if episode is None:
            raise NotFound(f"episode {episode_id!r} not found", param="episode_id")
        return episode

    @staticmethod
    async def _accounting(
        session: AsyncSession, episode_ids: Sequence[str]
    ) -> dict[str, CallAccounting]:
        if not episode_ids:
            return {}
        rows = await session.execute(
            select(Call.episode_id, Call.status, func.count())
            .where(Call.episode_id.in_(episode_ids))
            .group_by(Call.episode_id, Call.status)
        )
        by_episode: dict[str, dict[str, int]] = {}
        for episode_id, status, count in rows:
            by_episode.setdefault(episode_id, {})[status] = count
        return {
            episode_id: CallAccounting(
                admitted=sum(c.values()),
                completed=c.get("completed", 0),
                failed=c.get("failed", 0),
                cancelled=c.get("cancelled", 0),
                in_flight=c.get("admitted", 0),
            )
            for episode_id, c in by_episode.items()
        }

    # -- calls ------------------------------------------------------------------------------

    @staticmethod
    async def _next_seq(session: AsyncSession, episode_id: str, *, need_open: bool) -> int | None:
        query = update(Episode).where(Episode.episode_id == episode_id)
        if need_open:
            query = query.where(Episode.status == "open")
        result = await session.execute(query.values(seq=Episode.seq + 1).returning(Episode.seq))
        value = result.scalar_one_or_none()
        return None if value is None else int(value)

    async def admit(self, episode_id: str, admission: Admission) -> list[str]:
        """Admit a request's ``n`` choices as calls; returns their call ids (one per choice).

        Raises NotFound for an unknown episode, Conflict when it is not open.
        """
        request_id = new_id("call_")
        call_ids = (
            [request_id] if admission.n == 1 else [f"{request_id}-{i}" for i in range(admission.n)]
        )
        return await self.writer.admit(episode_id, admission, call_ids)

    async def complete(
        self,
        episode_id: str,
        call_ids: Sequence[str],
        generations: Sequence[Generation],
        base_call_id: str | None = None,
    ) -> bool:
        """Record the choices of one request as completed, all or nothing.

        ``base_call_id``: the recorded call the request extends (its continuation record); each
        choice then keeps its drift summary, whether that call's exact prompt + completion is a
        token prefix of its prompt (packed int32 ids: a token prefix is a byte prefix).
        Returns False (recording nothing) when a call is no longer ``admitted`` (it was cancelled
        by a close meanwhile): the caller must then not deliver the response as if recorded.
        """
        return (
            await self.writer.complete(episode_id, call_ids, generations, base_call_id) is not None
        )

    async def finish(
        self,
        episode_id: str,
        call_ids: Iterable[str],
        status: FailedStatus,
        error: str,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> int:
        """Move still-admitted calls to ``failed`` or ``cancelled``; returns how many moved."""
        if status not in {"failed", "cancelled"}:
            raise StoreError(f"finish() takes failed or cancelled, not {status!r}")
        return await self.writer.finish(episode_id, list(call_ids), status, error, prompt_token_ids)

    async def list_calls(self, episode_id: str) -> list[CallInfo]:
        async with self._sessions() as session:
            await self._episode(session, episode_id)
            calls = await session.scalars(
                select(Call).where(Call.episode_id == episode_id).order_by(Call.admitted_seq)
            )
            return [_call_info(c) for c in calls]

    def changes_elsewhere(self) -> int | None:
        """See :meth:`Writer.changes_elsewhere` (equal numbers: nobody else committed)."""
        return self.writer.changes_elsewhere()

    async def chat_calls_since(
        self, episode_id: str, agent_id: str | None, since: int = 0
    ) -> list[CompletedChatCall]:
        """The agent's completed chat calls with a continuation record and ``completed_seq``
        above ``since`` (unlabelled = one agent), in completion order."""
        return [
            CompletedChatCall(
                call_id=call_id, completed_seq=seq, role=role, continuation=record, reply_hash=reply
            )
            for call_id, seq, role, continuation, reply in await self.writer.chat_calls_since(
                episode_id, agent_id, since
            )
            if (record := parse_continuation(continuation)) is not None
        ]

    async def drift(self, episode_id: str) -> list[CallDrift]:
        """The per-call drift summaries of an episode (no token is loaded)."""
        async with self._sessions() as session:
            await self._episode(session, episode_id)
            rows = await session.execute(
                select(Call.status, Call.continuation, Call.token_prefix)
                .where(Call.episode_id == episode_id)
                .order_by(Call.admitted_seq)
            )
            return [
                CallDrift(status, parse_continuation(continuation), token_prefix)
                for status, continuation, token_prefix in rows
            ]

    async def call_tokens(self, call_id: str) -> tuple[list[int], list[int]]:
        """A call's exact prompt ids and sampled ids."""
        prompt, completion = await self.writer.call_tokens(call_id)
        return unpack_ids(prompt), unpack_ids(completion)

    async def outstanding(self, episode_id: str) -> list[str]:
        async with self._sessions() as session:
            ids = await session.scalars(
                select(Call.call_id)
                .where(Call.episode_id == episode_id, Call.status == "admitted")
                .order_by(Call.admitted_seq)
            )
            return list(ids)

    async def mark_call(
        self, episode_id: str, call_id: str, mark: Mark | None, role: Role | None = None
    ) -> CallInfo:
        async with self._sessions.begin() as session:
            episode = await self._episode(session, episode_id)
            if episode.status == "closed":
                raise Conflict(f"episode {episode_id!r} is closed; marks can no longer change")
            call = await session.get(Call, call_id)
            if call is None or call.episode_id != episode_id:
                raise NotFound(
                    f"call {call_id!r} not found in episode {episode_id!r}", param="call_id"
                )
            call.mark = mark
            if role is not None:
                call.role = role
            return _call_info(call)

    async def _apply_marks(
        self, session: AsyncSession, episode_id: str, marks: Mapping[str, Mark]
    ) -> None:
        for call_id, mark in marks.items():
            call = await session.get(Call, call_id)
            if call is None or call.episode_id != episode_id:
                raise NotFound(
                    f"call {call_id!r} not found in episode {episode_id!r}", param="call_id"
                )
            call.mark = mark

    # -- closing ----------------------------------------------------------------------------

    async def begin_close(
        self, episode_id: str, reward: float, marks: Mapping[str, Mark]
    ) -> EpisodeStatus:
        """Stop admissions at once (``closing``) and record the reward and marks.

        Returns the episode's status after the call: ``closing``, or ``closed`` when it was
        already closed with the same reward (idempotent). A different reward → Conflict.
        """
        async with self._sessions.begin() as session:
            episode = await self._episode(session, episode_id, lock=True)
            if episode.status != "open":
                if episode.reward != reward:
                    raise Conflict(
                        f"episode {episode_id!r} is {episode.status} with reward {episode.reward};"
                        f" cannot close it with reward {reward}",
                        code="reward_mismatch",
                    )
                if episode.status == "closed":
                    return "closed"
            await self._apply_marks(session, episode_id, marks)
            episode.status = "closing"
            episode.reward = reward
            return "closing"

    async def finish_close(self, episode_id: str) -> bool:
        """Close the episode if no call is outstanding; returns whether it is now closed."""
        async with self._sessions.begin() as session:
            episode = await self._episode(session, episode_id)
            if episode.status == "closed":
                return True
            pending = await session.scalar(
                select(func.count())
                .select_from(Call)
                .where(Call.episode_id == episode_id, Call.status == "admitted")
            )
            if pending:
                return False
            episode.status = "closed"
            episode.closed_at = utcnow()
            return True

    # -- bundles ----------------------------------------------------------------------------

    async def bundle(self, episode_id: str) -> EpisodeBundle:
        """The episode bundle (docs/formats.md): serialise it with ``to_dict()``."""
        async with self._sessions() as session:
            episode = await self._episode(session, episode_id)
            calls = await session.scalars(
                select(Call).where(Call.episode_id == episode_id).order_by(Call.admitted_seq)
            )
            return EpisodeBundle(
                episode_id=episode.episode_id,
                group_id=episode.group_id,
                status=episode.status,
                reward=episode.reward,
                metadata=dict(episode.metadata_ or {}),
                calls=tuple(_call_record(c) for c in calls),
            )


def _call_record(call: Call) -> CallRecord:
    return CallRecord(
        call_id=call.call_id,
        agent_id=call.agent_id,
        parent_agent_id=call.parent_agent_id,
        role=call.role,  # type: ignore[arg-type]
        status=call.status,  # type: ignore[arg-type]
        mark=call.mark,  # type: ignore[arg-type]
        admitted_seq=call.admitted_seq,
        completed_seq=call.completed_seq,
        finish_reason=call.finish_reason,
        prompt_token_ids=ids_array(call.prompt_token_ids),
        completion_token_ids=ids_array(call.completion_token_ids),
        completion_logprobs=logprobs_array(call.completion_logprobs),
        continuation=parse_continuation(call.continuation, f"call {call.call_id!r}"),
        error=call.error,
        weight_version=call.weight_version,
        constraint=call.constraint_kind,  # type: ignore[arg-type]
    )
