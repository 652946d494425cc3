"""One way to answer an error: the OpenAI-style body and the status the error carries."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from capture_contracts.errors import CaptureError
from capture_proxy.errors import ClientError

log = logging.getLogger("capture_proxy.app")


def error_response(exc: CaptureError) -> JSONResponse:
    """The answer to ``exc``; a fault that is not the client's is logged (never its secrets)."""
    if not isinstance(exc, ClientError):
        log.warning("request failed: %s: %s", type(exc).__name__, exc)
    # A 401 names the scheme (RFC 9110): the key goes in Authorization: Bearer (or x-api-key).
    headers = {"www-authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)
