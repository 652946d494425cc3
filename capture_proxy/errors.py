"""The one exception tree of the project.

::

    CaptureProxyError                 base; never raised itself
    ├── ClientError                   the caller's fault → 4xx with an OpenAI-style error body
    │   ├── BadRequest            400 malformed body, unknown field values
    │   ├── Unauthorized          401 missing or wrong API key
    │   ├── NotFound              404 unknown episode / call
    │   └── Conflict              409 not open, duplicate id, reward mismatch, calls outstanding
    ├── UpstreamError                 the engine failed → its own status (or 502) with an error body
    │   └── UpstreamTimeout       504
    ├── StoreError                    the transactional store failed → 500
    ├── ReconstructionError           a bundle cannot be turned into rows
    │   ├── InvalidBundle             the bundle is malformed (schema, array lengths)
    │   └── EpisodeRefused            accounting does not add up, or calls are unresolved
    ├── TrainerError                  rows cannot be trained
    │   └── InconsistentRows          rows of one episode disagree on reward or group
    └── EngineError                   the local vLLM process could not be started or stopped

Boundaries translate foreign exceptions (httpx, SQLAlchemy) into these with ``raise … from exc``.
"""

from __future__ import annotations

from typing import Any


class CaptureProxyError(Exception):
    """Base of every error this project raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra

    def to_body(self) -> dict[str, Any]:
        """The OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}


class ClientError(CaptureProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class BadRequest(ClientError):
    status_code = 400


class Unauthorized(ClientError):
    status_code = 401
    error_type = "authentication_error"


class NotFound(ClientError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(ClientError):
    status_code = 409
    error_type = "conflict_error"


class UpstreamError(CaptureProxyError):
    status_code = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, status_code: int | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        if status_code is not None:
            self.status_code = status_code


class UpstreamTimeout(UpstreamError):
    status_code = 504


class StoreError(CaptureProxyError):
    status_code = 500
    error_type = "store_error"


class ReconstructionError(CaptureProxyError):
    error_type = "reconstruction_error"


class InvalidBundle(ReconstructionError):
    pass


class EpisodeRefused(ReconstructionError):
    pass


class TrainerError(CaptureProxyError):
    error_type = "trainer_error"


class InconsistentRows(TrainerError):
    pass


class EngineError(CaptureProxyError):
    error_type = "engine_error"
