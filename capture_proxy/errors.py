"""The service's exception tree.

::

    CaptureError (capture_contracts.errors)
    └── CaptureProxyError             base of the service's errors; a bare one is a 500
        ├── ClientError               the caller's fault → 4xx with an OpenAI-style error body
        │   ├── BadRequest        400 malformed body, unknown field values
        │   ├── Unauthorized      401 missing or wrong API key
        │   ├── NotFound          404 unknown episode / call
        │   ├── Conflict          409 not open, duplicate id, reward mismatch, calls outstanding
        │   ├── PayloadTooLarge   413 body over limits.max_body_bytes (answered unread)
        │   └── ClientGone        499 the client left while its call waited (answered to nobody)
        ├── UpstreamError             the engine failed → its own status (or 502) with an error body
        │   └── UpstreamTimeout   504
        ├── StoreError                the transactional store failed → 500
        └── InvalidSettings           a CAPTURE_PROXY_* variable is malformed (commands: exit 2)

Format errors of shared data (``InvalidBundle``, ``InvalidRow``) come from
:mod:`capture_contracts.errors`; the app answers every :class:`CaptureError` with its
``to_body()``. Boundaries translate foreign exceptions (httpx, SQLAlchemy) into these with
``raise … from exc``.
"""

from __future__ import annotations

from typing import Any

from capture_contracts.errors import CaptureError


class CaptureProxyError(CaptureError):
    """Base of the service's errors."""


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


class PayloadTooLarge(ClientError):
    status_code = 413
    error_type = "invalid_request_error"


class ClientGone(ClientError):
    """The client closed its connection before the answer: its call was cancelled (the status
    is nginx's "client closed request"; the answer only reaches logs and tests)."""

    status_code = 499
    error_type = "client_disconnected"


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


class InvalidSettings(CaptureProxyError):
    """A setting from the environment is malformed; the message names the variable."""

    error_type = "settings_error"
