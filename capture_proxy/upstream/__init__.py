"""The engine seam: :class:`Upstream` (JSON and SSE over a small :class:`Transport`)."""

from capture_proxy.upstream.client import (
    RENDER_CHAT,
    TOKENIZE,
    SseBatches,
    Upstream,
    UpstreamReply,
    error_body_from,
    sse_events,
)
from capture_proxy.upstream.transport import RawResponse

__all__ = [
    "RENDER_CHAT",
    "TOKENIZE",
    "RawResponse",
    "SseBatches",
    "Upstream",
    "UpstreamReply",
    "error_body_from",
    "sse_events",
]
