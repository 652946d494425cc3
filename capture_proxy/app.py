"""The FastAPI application: engine, store and upstream are built in the lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capture_contracts.errors import CaptureError
from capture_proxy import __version__
from capture_proxy.api import anthropic, episodes, openai, responses
from capture_proxy.errors import BadRequest, CaptureProxyError, ClientError
from capture_proxy.proxy import CaptureService
from capture_proxy.settings import Settings, get_settings
from capture_proxy.store.db import make_engine, make_sessionmaker, upgrade_async
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream

log = logging.getLogger(__name__)


def _error(exc: CaptureError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status_code)


async def _on_capture_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CaptureError)
    if not isinstance(exc, ClientError):
        log.warning("request failed: %s: %s", type(exc).__name__, exc)
    return _error(exc)


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


def create_app(
    settings: Settings | None = None,
    *,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    migrate: bool = True,
) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if migrate:
            await upgrade_async(settings.store.url)
        engine = make_engine(settings.store.url, echo=settings.store.echo)
        upstream = Upstream(settings.upstream, transport=upstream_transport)
        app.state.service = CaptureService(settings, Store(make_sessionmaker(engine)), upstream)
        try:
            yield
        finally:
            await upstream.aclose()
            await engine.dispose()

    app = FastAPI(title="capture-proxy", version=__version__, lifespan=lifespan)
    app.add_exception_handler(CaptureError, _on_capture_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.include_router(episodes.router)
    app.include_router(openai.router)
    app.include_router(anthropic.router)  # Messages → chat (capture_proxy.api.edge)
    app.include_router(responses.router)  # Responses → chat (capture_proxy.api.edge)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> PlainTextResponse:
        service: CaptureService = request.app.state.service
        return PlainTextResponse(
            service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
