"""The base of the project's exception trees, and the errors of the shared formats.

::

    CaptureError                      base; never raised itself
    └── FormatError                   data breaks its documented format (docs/formats.md) → 400
        ├── InvalidBundle             an episode bundle (schema, fields, array lengths)
        └── InvalidRow                a training row (lengths, mask values, spans, reward)

Each package grows its own small tree from :class:`CaptureError`:
``capture_proxy.errors`` (client, upstream and store faults), ``reconstruct.errors``
(refused episodes), ``trainer_bridge.errors`` (untrainable rows), ``capture_devkit.engine``
(the local vLLM process). The HTTP status and error type are class data, and one
:meth:`CaptureError.to_body` gives the OpenAI-style error body everywhere.
"""

from __future__ import annotations

from typing import Any


class CaptureError(Exception):
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


class FormatError(CaptureError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidBundle(FormatError):
    pass


class InvalidRow(FormatError):
    pass
