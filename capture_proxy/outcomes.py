"""What the capture service answers: outcomes, not HTTP responses.

:meth:`~capture_proxy.proxy.CaptureService.handle` returns an :data:`Outcome`; the API layer
builds the HTTP answer of its own API from it — OpenAI's JSON and server-sent events
(:mod:`capture_proxy.api.answers`), or the Messages and Responses APIs' translations
(:mod:`capture_proxy.api.edge`) — without parsing back what the service would have serialised.

A stream is a series of :data:`Piece`: each batch of chat chunks as it arrived from the engine
(scrubbed of the capture fields the harness did not ask for), then one :class:`StreamEnd`, which
comes only after the call's completion is committed — or after it could not be. The last byte the
harness receives is built from it, so "the harness has the whole answer" still means "recorded"
(DESIGN §3). Closing the stream before its end cancels the call (recorded ``cancelled``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: the engine's JSON object, or an error body (the engine's, or the proxy's
    in OpenAI's shape), with its HTTP status and the call's headers (``X-Capture-Call-Id`` …)."""

    body: Any
    status_code: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a stream ends: the chunks that came with the engine's ``[DONE]``, then either
    ``[DONE]`` (``error`` None: the call is recorded) or an error body in OpenAI's shape (the
    call could not be recorded, or the engine's stream failed: the call is recorded failed or
    cancelled)."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None


#: One batch of chunks as the engine sent them, or the stream's end.
Piece = list[dict[str, Any]] | StreamEnd


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed answer (status 200). ``pieces`` must be closed (``aclose``) by its consumer:
    closing it before its :class:`StreamEnd` cancels the call."""

    pieces: AsyncGenerator[Piece, None]
    headers: Mapping[str, str] = field(default_factory=dict)


Outcome = Answer | Stream
