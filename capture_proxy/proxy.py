"""The capture path: admit → forward → capture → commit → answer (DESIGN §3).

The service answers outcomes (:mod:`capture_proxy.outcomes`), never HTTP responses: the API layer
builds those. A whole answer is returned, and a stream's end is yielded, only after the
completion is committed, so the harness's last byte (the whole body, or the stream's ``[DONE]``)
follows the commit. Every admitted call ends ``completed``, ``failed`` or ``cancelled``; the
in-flight registry lets a close cancel this process's calls upstream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import anyio
import orjson

from capture_contracts.vocabulary import (
    CANCELLED_BY_CLOSE,
    CLIENT_DISCONNECTED,
    Endpoint,
    FailedStatus,
)
from capture_proxy.attribution import AgentLinks, attribute
from capture_proxy.capture import (
    ClientWants,
    StreamCapture,
    generations_from_response,
    prepare_upstream_body,
    request_constraint,
    request_n,
    scrub,
    validate_body,
)
from capture_proxy.continuation import Continuations, Plan
from capture_proxy.errors import BadRequest, CaptureProxyError, Conflict, UpstreamError
from capture_proxy.in_flight import InFlight, abandon, call_headers, client_left, gone, hung_up
from capture_proxy.metrics import CallTimer, Metrics
from capture_proxy.outcomes import Answer, Outcome, Piece, Stream, StreamEnd
from capture_proxy.responses import ClientWatch
from capture_proxy.settings import Settings
from capture_proxy.store.records import Admission, Generation
from capture_proxy.store.repository import Store
from capture_proxy.upstream import (
    RawResponse,
    SseBatches,
    Upstream,
    UpstreamReply,
    error_body_from,
)
from capture_proxy.weights import WeightGate

log = logging.getLogger(__name__)

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# A completion the store refused: the call was resolved while it ran (cancelled by a close, or
# failed as proxy_restart after this instance's lease lapsed); the answer is not recorded.
_RESOLVED_MEANWHILE = (
    "this call was resolved while it ran (its episode was closed, or this proxy's lease lapsed);"
    " its answer is not recorded"
)


def _pass_on(
    events: list[str], entry: InFlight, capture: StreamCapture, wants: ClientWants
) -> tuple[list[dict[str, Any]], bool]:
    """Capture a batch of streamed chunks; what the harness gets of them, and whether [DONE] came.

    What arrived together goes out together (one piece: one write).
    """
    out: list[dict[str, Any]] = []
    for data in events:
        if data.strip() == "[DONE]":
            return out, True
        chunk = orjson.loads(data)
        if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
            raise UpstreamError(f"engine error in stream: {chunk['error']}")
        capture.feed(chunk)
        if entry.plan is not None:
            entry.plan.replies.feed(chunk)
        out.append(scrub(chunk, wants))
    return out, False


def _token_counts(generations: list[Generation]) -> tuple[int, int]:
    """(prompt, completion) tokens recorded by a request's choices (metrics)."""
    prompt = sum(len(g.prompt_token_ids) for g in generations)
    return prompt, sum(len(g.completion_token_ids) for g in generations)


def _internal(exc: Exception) -> str:
    """The recorded reason of a call failed by a fault of the proxy's own."""
    return f"internal error: {type(exc).__name__}: {exc}"[:500]


class CaptureService:
    def __init__(self, settings: Settings, store: Store, upstream: Upstream) -> None:
        self.settings = settings
        self.store = store
        self.upstream = upstream
        self._in_flight: dict[str, InFlight] = {}
        self.metrics = Metrics(
            in_flight=lambda: sum(len(e.call_ids) for e in self._in_flight.values())
        )
        self.continuations = Continuations(settings, store, upstream)
        self.links = AgentLinks(settings.attribution.remembered_episodes)
        self.weights = WeightGate(
            settings.weights.initial_version, hold_limit_s=settings.weights.hold_limit_s
        )

    def _release(self, request_id: str) -> None:
        """A request is over (any outcome): out of the registry, out of the weight gate."""
        if self._in_flight.pop(request_id, None) is not None:
            self.weights.leave()

    # -- cancellation (used by close) -------------------------------------------------------

    async def cancel_in_flight(self, episode_id: str) -> None:
        """Abort this process's upstream requests of an episode; their handlers record them.

        Whole requests are cancelled at once; streams stop at their next chunk (closing the
        engine's response, which aborts the request there).
        """
        for entry in list(self._in_flight.values()):
            if entry.episode_id != episode_id:
                continue
            entry.cancelled.set()
            entry.task.cancel()

    # -- the proxy --------------------------------------------------------------------------

    async def models(self) -> Answer:
        reply = await self.upstream.get_json("/v1/models")
        return Answer(reply.body, reply.status_code)

    async def handle(
        self,
        episode_id: str,
        endpoint: Endpoint,
        body: Any,
        headers: Mapping[str, str],
        watch: ClientWatch | None = None,
    ) -> Outcome:
        """One generation request. ``watch`` (started once the body is read, stopped by the
        caller when this returns) tells when the client leaves: the engine's request is then
        cancelled and the call recorded ``cancelled`` (``client_disconnected``) — while the
        engine works on a whole answer, or before a stream's first bytes; a started stream is
        watched by its own response."""
        timer = self.metrics.timer(endpoint)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        validate_body(endpoint, body)
        attribution, forwarded = attribute(headers, body, self.settings.attribution)
        if self.settings.attribution.remember_parents:
            attribution = self.links.resolve(episode_id, attribution)
        else:
            attribution = dataclasses.replace(attribution, episode_id=episode_id)
        transform = self.settings.upstream.transform
        if transform is not None:
            forwarded = transform(forwarded, attribution)
            if not isinstance(forwarded, dict):
                raise CaptureProxyError("the configured request transform did not return a dict")
        upstream_body, wants = prepare_upstream_body(endpoint, forwarded, self.settings.upstream)
        n = request_n(body)
        stream = bool(body.get("stream"))
        context_agent = attribution.context_agent_id or attribution.agent_id  # issue 13 hook
        version = await self.weights.enter()  # held here while the weights change
        sending: asyncio.Task[Any] | None = None
        try:
            planning = time.perf_counter()
            plan = await self.continuations.plan(episode_id, endpoint, context_agent, upstream_body)
            self.metrics.planned(plan.record, time.perf_counter() - planning)
            # The engine starts on the call while its admission commits, so the commit (an
            # fsync with the default store settings) is not on the call's path. A refused
            # admission aborts the engine's request; nothing but the refusal is answered.
            sending = asyncio.create_task(self._send(timer, plan, endpoint, upstream_body, stream))
            call_ids = await self.store.admit(
                episode_id,
                Admission(
                    endpoint=endpoint,
                    stream=stream,
                    n=n,
                    role=attribution.role,
                    agent_id=attribution.agent_id,
                    parent_agent_id=attribution.parent_agent_id,
                    model=body.get("model") if isinstance(body.get("model"), str) else None,
                    continuation=plan.record,
                    weight_version=version,
                    constraint=request_constraint(upstream_body),
                ),
            )
        except BaseException:
            if sending is not None:
                await abandon(sending, stream)
            self.weights.leave()
            raise
        self.metrics.admitted(endpoint, n, plan.record, attribution.role)
        request_id = call_ids[0] if n == 1 else call_ids[0].rsplit("-", 1)[0]
        entry = InFlight(
            episode_id, call_ids, timer, attribution.role, attribution.agent_id, sending, plan
        )
        self._in_flight[request_id] = entry
        if watch is not None:  # (its owner stops it once this returns)
            watch.on_leave(lambda: client_left(entry))
        try:
            if stream:
                return await self._streamed(entry, request_id, endpoint, wants, n)
            return await self._whole(entry, request_id, endpoint, wants, n)
        except BaseException:
            self._release(request_id)
            raise

    async def _send(
        self,
        timer: CallTimer,
        plan: Plan,
        endpoint: Endpoint,
        upstream_body: dict[str, Any],
        stream: bool,
    ) -> Any:
        """The engine's answer (a whole reply), or its stream once its headers came.

        Its own coroutine, so that a task of it cancelled before it ran (an admission refused
        at once) leaves no request to the engine begun, nor a coroutine never awaited."""
        send = self.upstream.open_stream if stream else self.upstream.post_json
        return await timer.upstream(send(PATHS[endpoint], plan.upstream_body(upstream_body)))

    async def _fail(self, entry: InFlight, status: FailedStatus, reason: str) -> None:
        with anyio.CancelScope(shield=True):
            moved = await self.store.finish(entry.episode_id, entry.call_ids, status, reason)
        self.metrics.finished(status, moved, entry.role)

    async def _complete(self, entry: InFlight, generations: list[Generation]) -> bool:
        record = entry.plan.record if entry.plan is not None else None
        base = record.base_call_id if record is not None else None
        with self.metrics.commit_timer():
            seqs = await self.store.writer.complete(
                entry.episode_id,
                entry.call_ids,
                generations,
                base,
                alone=len(self._in_flight) == 1,  # (this call's own entry)
            )
        moved = len(entry.call_ids) if seqs is not None else 0
        self.metrics.finished("completed", moved, entry.role, _token_counts(generations))
        if seqs is None:
            return False
        self.continuations.remember(
            entry.episode_id,
            entry.agent_id,
            entry.role,
            entry.plan,
            entry.call_ids,
            generations,
            seqs,
        )
        return True

    async def _whole(
        self,
        entry: InFlight,
        request_id: str,
        endpoint: Endpoint,
        wants: ClientWants,
        n: int,
    ) -> Answer:
        headers = call_headers(entry.call_ids, request_id)
        try:
            try:
                reply: UpstreamReply = await entry.task
            except asyncio.CancelledError:
                if hung_up(entry):
                    await self._fail(entry, "cancelled", CLIENT_DISCONNECTED)
                    return gone(headers)
                if not entry.cancelled.is_set():
                    raise
                await self._fail(entry, "cancelled", CANCELLED_BY_CLOSE)
                raise Conflict(
                    "the episode was closed while this call ran; call cancelled"
                ) from None
            if reply.status_code >= 400:
                message = str(reply.body.get("error", {}).get("message", ""))
                await self._fail(entry, "failed", f"upstream {reply.status_code}: {message}")
                return Answer(reply.body, reply.status_code, headers)
            generations = generations_from_response(endpoint, reply.body, n)
            generations = self.continuations.replies(entry.plan, generations, reply.body)
            if not await self._complete(entry, generations):
                raise Conflict(_RESOLVED_MEANWHILE, code="call_resolved")
            return Answer(scrub(reply.body, wants), 200, headers)
        except CaptureProxyError as exc:
            await self._fail(entry, "failed", f"{type(exc).__name__}: {exc.message}")
            raise
        except Exception as exc:  # a fault of the proxy's own: failed, not "disconnected"
            await self._fail(entry, "failed", _internal(exc))
            raise
        except BaseException:
            await self._fail(entry, "cancelled", CLIENT_DISCONNECTED)
            raise
        finally:
            self._release(request_id)
            self.metrics.observe(entry.timer)

    async def _streamed(
        self,
        entry: InFlight,
        request_id: str,
        endpoint: Endpoint,
        wants: ClientWants,
        n: int,
    ) -> Answer | Stream:
        headers = call_headers(entry.call_ids, request_id)
        try:
            response: RawResponse = await entry.task
        except CaptureProxyError as exc:
            await self._fail(entry, "failed", f"{type(exc).__name__}: {exc.message}")
            raise
        except asyncio.CancelledError:
            if not hung_up(entry):
                raise
            await self._fail(entry, "cancelled", CLIENT_DISCONNECTED)
            self._release(request_id)
            self.metrics.observe(entry.timer)
            return gone(headers)
        if response.status_code >= 400:
            raw = await response.aread()
            await response.aclose()
            body = error_body_from(response.status_code, raw)
            await self._fail(entry, "failed", f"upstream {response.status_code}: {raw[:500]!r}")
            self._release(request_id)
            self.metrics.observe(entry.timer)
            return Answer(body, response.status_code, headers)
        return Stream(self._relay(entry, request_id, endpoint, response, wants, n), headers)

    async def _relay_failed(self, entry: InFlight, exc: Exception) -> dict[str, Any]:
        """Record a stream that could not finish; the error that ends it."""
        if entry.cancelled.is_set():
            await self._fail(entry, "cancelled", CANCELLED_BY_CLOSE)
            return Conflict("the episode was closed; this call was cancelled").to_body()
        if isinstance(exc, CaptureProxyError | ValueError):  # (ValueError: a chunk not JSON)
            message = exc.message if isinstance(exc, CaptureProxyError) else str(exc)
            await self._fail(entry, "failed", f"{type(exc).__name__}: {message}")
            error = exc if isinstance(exc, CaptureProxyError) else UpstreamError(message)
            return error.to_body()
        log.error("stream relay failed", exc_info=exc)  # a fault of the proxy's own
        await self._fail(entry, "failed", _internal(exc))
        return CaptureProxyError("internal error").to_body()

    async def _relay(
        self,
        entry: InFlight,
        request_id: str,
        endpoint: Endpoint,
        response: RawResponse,
        wants: ClientWants,
        n: int,
    ) -> AsyncGenerator[Piece, None]:
        """Pass the engine's chunks through while capturing tokens; the end only after commit.

        The chunks that came with the engine's [DONE] go out in the :class:`StreamEnd`, after
        the commit (the response's last write: a stream that arrives whole is one write)."""
        capture = StreamCapture(endpoint, n)
        settled = done = False
        tail: list[dict[str, Any]] = []
        try:
            batches = SseBatches(response)
            while (events := await entry.timer.upstream(batches.next())) is not None:
                out, done = _pass_on(events, entry, capture, wants)
                if done:
                    tail = out
                elif out:
                    yield out
                if entry.cancelled.is_set():
                    raise UpstreamError("cancelled by close")
                if done:
                    break
            if not done:
                raise UpstreamError("the engine's stream ended without [DONE]")
            generations = self.continuations.replies(entry.plan, capture.generations())
            if await self._complete(entry, generations):
                settled = True
                yield StreamEnd(tail)
            else:
                settled = True
                conflict = Conflict(_RESOLVED_MEANWHILE, code="call_resolved")
                yield StreamEnd(tail, conflict.to_body())
        except Exception as exc:
            settled = True
            yield StreamEnd(tail, await self._relay_failed(entry, exc))
        finally:
            self._release(request_id)
            self.metrics.observe(entry.timer)
            with anyio.CancelScope(shield=True):
                if done:  # read the stream's end, so its connection serves the next call
                    await response.finish()
                await response.aclose()
                if not settled:
                    reason = CANCELLED_BY_CLOSE if entry.cancelled.is_set() else CLIENT_DISCONNECTED
                    await self._fail(entry, "cancelled", reason)
