"""The app's OpenAPI document, made to describe what the routes really do.

- The OpenAI routes read their raw body (strictly, :mod:`capture_proxy.api.json_body`); their
  request bodies are the permissive models of :mod:`capture_proxy.api.openai_schemas`, added to
  the components here.
- Validation errors are answered 400 in OpenAI's error shape, never FastAPI's 422: the 422
  entries FastAPI adds are removed.
- With an admin key the security schemes are declared (bearer admin key on the episode API; the
  episode's key as bearer or ``x-api-key`` on the OpenAI routes); without one nothing needs a key
  and none is declared.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from capture_proxy.api.openai_schemas import ChatCompletionBody, CompletionBody
from capture_proxy.settings import Settings

_BODIES = (ChatCompletionBody, CompletionBody)
_SCHEMES = {
    "adminKey": {"type": "http", "scheme": "bearer", "description": "auth.admin_key"},
    "episodeKey": {"type": "http", "scheme": "bearer", "description": "the episode's api_key"},
    "episodeApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def _operations(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for item in document.get("paths", {}).values() for op in item.values()]


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, definitions = models_json_schema(
        [(model, "validation") for model in _BODIES], ref_template="#/components/schemas/{model}"
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(definitions.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for operation in _operations(document):
        operation.get("responses", {}).pop("422", None)
    if settings.auth.admin_key is not None:
        document["components"]["securitySchemes"] = _SCHEMES
        for operation in _operations(document):
            tags = operation.get("tags", [])
            if "episodes" in tags:
                operation["security"] = [{"adminKey": []}]
            elif "openai" in tags:
                operation["security"] = [{"episodeKey": []}, {"episodeApiKey": []}]
    return document


def install_openapi(app: FastAPI, settings: Settings) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
