"""The FastAPI application: engine, store and upstream are built in the lifespan."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capture_contracts.errors import CaptureError
from capture_proxy import __version__
from capture_proxy.api import anthropic, episodes, openai, responses, viewer, weights
from capture_proxy.api.body_limit import BodyLimit
from capture_proxy.api.capture_router import CaptureRouter
from capture_proxy.api.error_response import error_response
from capture_proxy.api.openai_schemas import ERROR_RESPONSES
from capture_proxy.api.openapi import install_openapi
from capture_proxy.engine_vocab import EngineVocabulary
from capture_proxy.errors import BadRequest, CaptureProxyError, StoreError
from capture_proxy.proxy import CaptureService
from capture_proxy.settings import Settings, get_settings
from capture_proxy.store.db import make_engine, make_sessionmaker, upgrade_async
from capture_proxy.store.leases import InstanceIdentity, InstanceLease
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream

log = logging.getLogger(__name__)

APP_DESCRIPTION = (
    "Records every model call of an agent harness (exact prompt token ids, sampled ids, "
    "behaviour logprobs) grouped by episode and agent, on its way to a vLLM server. "
    "Harnesses use the OpenAI-compatible routes; trainers and operators the episode routes."
)


def _error(exc: CaptureError) -> JSONResponse:
    return error_response(exc)


async def _on_capture_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CaptureError)
    return error_response(exc)


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
    return _error(BadRequest(message, param=where or None))


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = CaptureProxyError(str(exc.detail))
    error.status_code = exc.status_code
    error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(error)


async def _check(probe: Awaitable[None]) -> str:
    """``"ok"``, or the one-line reason a readiness probe failed."""
    try:
        await probe
    except CaptureError as exc:
        return exc.message
    return "ok"


def create_app(
    settings: Settings | None = None,
    *,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    migrate: bool = True,
    freeze_startup_heap: bool = False,
) -> FastAPI:
    """The proxy's ASGI app; the generation routes' fast lane wraps FastAPI's middleware.

    ``freeze_startup_heap`` (the served process, ``capture-proxy serve``): once started, what
    the imports and the startup made is moved out of the cyclic collector's sight
    (``gc.freeze``). It lives as long as the process, and a full collection walked all of it:
    ~140k objects, ~95 ms of CPU on the loop every few seconds under load (issue 11), a p99 of
    tens of milliseconds. Frozen objects are still freed by reference counting.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if migrate:
            await upgrade_async(settings.store.url)
        engine = make_engine(settings.store.url, echo=settings.store.echo)
        upstream = Upstream(settings.upstream, transport=upstream_transport)
        identity = InstanceIdentity.new(settings.store.instance_name)
        store = Store(
            make_sessionmaker(engine),
            sqlite_synchronous=settings.store.sqlite_synchronous,
            max_batch=settings.store.max_batch,
            identity=identity,
            lease_s=settings.store.lease_s,
        )
        app.state.service = service = CaptureService(settings, store, upstream)
        lease = InstanceLease(
            store.writer, identity, settings.store.lease_s, service.metrics.orphans_resolved
        )
        app.state.vocabulary = EngineVocabulary(upstream, settings.limits.vocab_size)
        app.state.lease = lease
        try:
            await lease.start()
            if freeze_startup_heap:
                gc.collect()
                gc.freeze()
            yield
        finally:
            await lease.stop()
            await upstream.aclose()
            await store.aclose()
            await engine.dispose()

    app = FastAPI(
        title="capture-proxy",
        version=__version__,
        description=APP_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    # Middleware added later wraps what was added before: the body limit is outermost, so the
    # generation routes' fast lane (inside it) never reads a body past the limit.
    app.add_middleware(CaptureRouter, service=lambda: app.state.service)
    app.add_middleware(BodyLimit, max_body_bytes=settings.limits.max_body_bytes)
    app.add_exception_handler(CaptureError, _on_capture_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.include_router(episodes.router)
    app.include_router(weights.router)  # the served policy version (capture_proxy/weights.py)
    app.include_router(openai.router)
    app.include_router(anthropic.router)  # Messages → chat (capture_proxy.api.edge)
    app.include_router(responses.router)  # Responses → chat (capture_proxy.api.edge)

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers (no dependency is checked)."""
        return {"status": "ok"}

    app.add_api_route("/health", healthz, methods=["GET"], include_in_schema=False)  # alias

    @app.get(
        "/readyz",
        tags=["operations"],
        responses={503: {"description": "The store or the engine is not reachable."}},
    )
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: the store answers a query and the engine its health route (else 503)."""
        service: CaptureService = request.app.state.service
        upstream = service.settings.upstream
        checks = await asyncio.gather(
            _check(service.store.health.ping()),
            _check(service.upstream.ping(upstream.health_path, upstream.ready_timeout_s)),
        )
        ready = all(result == "ok" for result in checks)
        body = {
            "status": "ready" if ready else "not_ready",
            "store": checks[0],
            "engine": checks[1],
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["operations"])
    async def metrics(request: Request) -> PlainTextResponse:
        """Prometheus text format (capture_proxy/metrics.py lists the series)."""
        service: CaptureService = request.app.state.service
        try:
            episodes: dict[str, int] | None = await service.store.health.episode_counts()
        except StoreError as exc:
            log.warning("metrics: no episode gauge: %s", exc.message)
            episodes = None
        return PlainTextResponse(
            service.metrics.render(episodes), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    app.include_router(viewer.router, responses={404: ERROR_RESPONSES[404]})
    install_openapi(app, settings)
    return app
