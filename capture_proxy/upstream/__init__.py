"""The engine seam: :class:`Upstream` (JSON and SSE over a small :class:`Transport`)."""

from capture_proxy.upstream.client import (
    DERENDER_CHAT,
    GENERATE,
    RENDER_CHAT,
    TOKENIZE,
    Upstream,
    UpstreamReply,
    error_body_from,
    sse_batches,
    sse_events,
)
from capture_proxy.upstream.transport import RawResponse

__all__ = [
    "DERENDER_CHAT",
    "GENERATE",
    "RENDER_CHAT",
    "TOKENIZE",
    "RawResponse",
    "Upstream",
    "UpstreamReply",
    "error_body_from",
    "sse_batches",
    "sse_events",
]
