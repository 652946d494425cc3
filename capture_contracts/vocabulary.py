"""The project's vocabulary (DESIGN §2) as ``Literal`` types, with their value sets.

Every module that names a role, a call state, a mark or a fallback reason imports it from here.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

#: What a call's output is: an action (``policy``), a context summary (``compaction``), or
#: something that is not an action at all (``auxiliary``: titles, probes).
Role = Literal["policy", "compaction", "auxiliary"]
#: ``admitted`` → ``completed`` | ``failed`` | ``cancelled``; one left ``admitted`` is unresolved.
CallStatus = Literal["admitted", "completed", "failed", "cancelled"]
#: The terminal states a call reaches without a completion.
FailedStatus = Literal["failed", "cancelled"]
EpisodeStatus = Literal["open", "closing", "closed"]
#: A harness's acknowledgement of a call (DESIGN §5 rule 3).
Mark = Literal["discarded", "accepted"]
#: Where the accounting puts each admitted call (DESIGN §5 rule 7).
Classification = Literal[
    "trained", "conditioning_only", "discarded_retry", "failed", "cancelled", "unresolved"
]
#: The OpenAI-compatible generation endpoints the proxy captures.
Endpoint = Literal["chat", "completions"]
#: How the proxy builds a chat call's prompt (exact-token continuation).
ContinuationMode = Literal["stitch", "passthrough"]
#: Why a chat call's prompt was rendered fresh instead of stitched.
FallbackReason = Literal[
    "no_previous_call",  # the agent's first call: a root
    "not_an_extension",  # the messages do not continue any recorded call of the agent
    "assistant_edited",  # history matches a call, but the harness changed its assistant message
    "tools_changed",  # extends a call, but the tool list differs (the system turn re-renders)
    "template_not_prefix_stable",  # rendering the longer history changed earlier tokens
    "compaction_rewrite",  # the agent's context was rewritten after a compaction call
    "not_chat",  # /v1/completions: the harness sends tokens or text itself
    "token_path_unavailable",  # the engine refused render (e.g. no --enable-scale-out)
    "render_failed",  # the engine could not render the request (its own error follows)
    "passthrough_mode",  # an extension, but the proxy runs with continuation=passthrough
    "stop_strings",  # (recorded before stitched calls went to the chat route, which honours them)
    "echo",  # an extension asking for echo: the engine renders the messages itself
    "media_content",  # an extension with non-text content parts: the engine renders those itself
]

#: How a call's tokens were grammar-constrained (the request field that made the engine mask its
#: logits at every decoding step): ``structured_outputs``' kinds, ``response_format`` json
#: (``json_object`` / ``json_schema``), or a ``tool_choice`` that forces a tool call.
Constraint = Literal[
    "regex", "json", "choice", "grammar", "structural_tag", "json_object", "tool_choice"
]

ROLES: Final[frozenset[str]] = frozenset(get_args(Role))
CONSTRAINTS: Final[frozenset[str]] = frozenset(get_args(Constraint))
CALL_STATUSES: Final[frozenset[str]] = frozenset(get_args(CallStatus))
EPISODE_STATUSES: Final[frozenset[str]] = frozenset(get_args(EpisodeStatus))
MARKS: Final[frozenset[str]] = frozenset(get_args(Mark))
CLASSIFICATIONS: Final[tuple[str, ...]] = get_args(Classification)
FALLBACK_REASONS: Final[frozenset[str]] = frozenset(get_args(FallbackReason))
CONTINUATION_MODES: Final[frozenset[str]] = frozenset(get_args(ContinuationMode))
DEFAULT_TRAINABLE_ROLES: Final[frozenset[str]] = frozenset({"policy", "compaction"})

#: ``error`` of a call cancelled because its episode was closed with ``cancel_outstanding``.
CANCELLED_BY_CLOSE: Final = "cancelled_by_close"
#: ``error`` of a call cancelled because the harness went away before its answer was complete.
CLIENT_DISCONNECTED: Final = "client_disconnected"
#: ``error`` of a call failed because the proxy instance that admitted it is gone: killed (its
#: lease expired), restarted under the same name, or stopped with the call still unresolved.
PROXY_RESTART: Final = "proxy_restart"

#: The response header that names a request's call (its request id when it asked for ``n`` > 1
#: choices): the stable reference a harness acknowledges the call by
#: (``PATCH /episodes/{id}/calls/{call_id}``).
CALL_ID_HEADER: Final = "X-Capture-Call-Id"
#: The response header listing every call of the request, one per choice, comma-separated.
CALL_IDS_HEADER: Final = "X-Capture-Call-Ids"
