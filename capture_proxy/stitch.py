"""Exact-token continuation ("stitching"): pure decisions, no I/O (DESIGN §8, issue 7).

A chat request *extends* a recorded call of the same agent when its messages begin with that
call's messages plus the assistant message the proxy returned for it. Messages are compared in a
normalised form through a hash chain (:mod:`capture_proxy.message_chain`), so a call only
stores two hashes: ``prefix_hash`` (its own messages) and ``reply_hash`` (its messages plus its
returned assistant message).

The stitched prompt is the base call's exact prompt ids + its exact completion ids (+ the
end-of-turn id when the completion did not end with it) + the template's trailer after that
end-of-turn token + the template's tokens for the appended messages. The last two come from two
renders: the messages up to and including the returned assistant message (no generation prompt),
and the full request; the first must be a token prefix of the second (prefix-stable template).

One render is enough where the full render begins with the base call's own render (its messages
and the generation prompt: :class:`OwnRender`) and the template renders an assistant message the
same way whether it is the last message or not: the returned message's rendering then ends at the
first end-of-turn token after that prefix (:func:`stitch_on_render`). The second property is the
template's, not the request's, and is learned, never assumed: per :func:`head_shape` (the fields
that reach the template, the returned message's shape, the roles appended after it), a stitch
that made both renders shows whether the one-render cut gives the same ids (and one in so many
later stitches of the shape checks it again: :mod:`capture_proxy.render_shapes`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from capture_contracts.vocabulary import FallbackReason
from capture_proxy.message_chain import canonical_json

# -- the assistant message the proxy returned -------------------------------------------------


def reply_message(choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a harness appends after a whole (non-streamed) chat choice."""
    message = choice.get("message") or {}
    return {
        "role": "assistant",
        "content": message.get("content"),
        "tool_calls": message.get("tool_calls") or [],
    }


@dataclass(slots=True)
class _Reply:
    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)


@dataclass(slots=True)
class ReplyAccumulator:
    """Rebuilds each choice's assistant message from streamed chat chunks."""

    replies: dict[int, _Reply] = field(default_factory=dict)

    def feed(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            reply = self.replies.setdefault(int(choice.get("index", 0)), _Reply())
            delta = choice.get("delta") or {}
            if delta.get("content"):
                reply.content.append(str(delta["content"]))
            for part in delta.get("tool_calls") or []:
                slot = reply.calls.setdefault(int(part.get("index", 0)), {"name": "", "args": ""})
                function = part.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["args"] += function.get("arguments") or ""

    def message(self, index: int) -> dict[str, Any]:
        reply = self.replies.get(index, _Reply())
        calls = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for _, c in sorted(reply.calls.items())
        ]
        content = "".join(reply.content) if reply.content else None
        return {"role": "assistant", "content": content, "tool_calls": calls}


# -- choosing the call to continue ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OwnRender:
    """The engine's render of a call's own request (its messages and the generation prompt),
    kept as its length and digest: a later request's render that begins with it renders the
    call's messages as they were rendered for the call."""

    length: int
    digest: str

    @classmethod
    def of(cls, ids: list[int]) -> OwnRender:
        return cls(len(ids), render_digest(ids))


def render_digest(ids: list[int]) -> str:
    """SHA-256 of the ids written as a compact JSON array (``[1,2,3]``), 32 hex digits.

    Written by orjson and hashed with SHA-256 (hardware-accelerated on x86 and arm64): ~0.15 ms
    at 20k ids, where packing them as int32 first took twice that (``array`` from a list).
    """
    return hashlib.sha256(orjson.dumps(ids)).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class PriorCall:
    """What stitching needs to know of one completed chat call of the agent."""

    call_id: str
    completed_seq: int
    role: str
    messages: int  # number of request messages
    prefix_hash: str  # h_messages of its request
    reply_hash: str | None  # h_{messages+1}: its request plus the returned assistant message
    tools_hash: str
    #: Its prompt is the engine's render of its request (it was not stitched).
    rendered_prompt: bool = False
    #: A stitched call: the engine's render of its request, which its prompt is not.
    render: OwnRender | None = None


@dataclass(frozen=True, slots=True)
class Extends:
    base: PriorCall


@dataclass(frozen=True, slots=True)
class Fresh:
    reason: FallbackReason
    base: PriorCall | None = None  # the call it extends at message level, if any


def choose_base(priors: Sequence[PriorCall], hashes: Sequence[str], tools: str) -> Extends | Fresh:
    """The latest longest recorded call this request extends, or why there is none."""
    if not priors:
        return Fresh("no_previous_call")
    m = len(hashes) - 1
    matches = [p for p in priors if p.messages + 1 <= m and hashes[p.messages + 1] == p.reply_hash]
    if matches:
        same_tools = [p for p in matches if p.tools_hash == tools]
        if not same_tools:
            return Fresh("tools_changed", max(matches, key=_rank))
        return Extends(max(same_tools, key=_rank))
    # A compaction just before wins: a rewrite that keeps the first messages (Codex keeps the
    # user turns and appends the summary) is not an edited assistant message.
    if max(priors, key=lambda p: p.completed_seq).role == "compaction":
        return Fresh("compaction_rewrite")
    if any(p.messages < m and hashes[p.messages] == p.prefix_hash for p in priors):
        return Fresh("assistant_edited")
    return Fresh("not_an_extension")


def _rank(prior: PriorCall) -> tuple[int, int]:
    return prior.messages, prior.completed_seq


class Priors:
    """One agent's recorded calls, indexed so that choosing a base costs O(messages), not O(calls).

    Same answers as :func:`choose_base` over the same calls (a property test holds them equal):
    a prior P is extended by a request when ``hashes[P.messages + 1] == P.reply_hash``, so the
    request's own hash chain is looked up in a dict of reply hashes; ``assistant_edited`` looks up
    its prefix hashes the same way; ``compaction_rewrite`` needs only the latest call.
    """

    def __init__(self) -> None:
        self._by_reply: dict[str, list[PriorCall]] = {}
        self._by_prefix: dict[str, list[PriorCall]] = {}
        self._ids: set[str] = set()
        self.latest: PriorCall | None = None
        #: Every call up to this ``completed_seq`` has been read from the store (calls added
        #: since by this process may lie beyond it; reading again from here finds the rest).
        self.read_until = 0
        #: ``Store.changes_elsewhere()`` when the store was last read (None: not known).
        self.seen_elsewhere: int | None = None

    def add(self, prior: PriorCall) -> None:
        if prior.call_id in self._ids:
            return
        self._ids.add(prior.call_id)
        if prior.reply_hash is not None:
            self._by_reply.setdefault(prior.reply_hash, []).append(prior)
        self._by_prefix.setdefault(prior.prefix_hash, []).append(prior)
        if self.latest is None or prior.completed_seq > self.latest.completed_seq:
            self.latest = prior

    def choose(self, hashes: Sequence[str], tools: str) -> Extends | Fresh:
        if self.latest is None:
            return Fresh("no_previous_call")
        m = len(hashes) - 1
        matches = [
            p
            for k in range(1, m + 1)
            for p in self._by_reply.get(hashes[k], ())
            if p.messages + 1 == k
        ]
        if matches:
            same_tools = [p for p in matches if p.tools_hash == tools]
            if not same_tools:
                return Fresh("tools_changed", max(matches, key=_rank))
            return Extends(max(same_tools, key=_rank))
        if self.latest.role == "compaction":  # as choose_base: a rewrite, not an edit
            return Fresh("compaction_rewrite")
        if any(p.messages == k for k in range(m) for p in self._by_prefix.get(hashes[k], ())):
            return Fresh("assistant_edited")
        return Fresh("not_an_extension")


# -- the stitched prompt ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stitched:
    prompt_ids: list[int]
    base_len: int  # len(base prompt + base completion [+ end-of-turn])
    trailer: list[int]  # the template's tokens after the end-of-turn token
    suffix: list[int]  # the template's tokens for the appended messages (+ generation prompt)


def stitch_prompt(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    end_of_turn_id: int,
    with_reply_ids: Sequence[int],
    full_ids: Sequence[int],
) -> Stitched | Fresh:
    """Base prompt + completion (+ end-of-turn) + trailer + rendered suffix.

    ``with_reply_ids``: the render of the messages up to and including the returned assistant
    message (no generation prompt); ``full_ids``: the render of the whole request.
    """
    cut = len(with_reply_ids)
    if list(full_ids[:cut]) != list(with_reply_ids) or end_of_turn_id not in with_reply_ids:
        return Fresh("template_not_prefix_stable")
    last_eot = cut - 1 - list(reversed(with_reply_ids)).index(end_of_turn_id)
    trailer = list(with_reply_ids[last_eot + 1 :])
    base = _base(prompt_ids, completion_ids, end_of_turn_id)
    suffix = list(full_ids[cut:])
    return Stitched([*base, *trailer, *suffix], len(base), trailer, suffix)


def _base(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], end_of_turn_id: int
) -> list[int]:
    """The base call's exact prompt + completion, ended by the end-of-turn id."""
    completion = list(completion_ids)
    if not completion or completion[-1] != end_of_turn_id:
        completion.append(end_of_turn_id)
    return [*prompt_ids, *completion]


def stitch_on_render(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    end_of_turn_id: int,
    own_len: int,
    full_ids: Sequence[int],
) -> Stitched | None:
    """Base prompt + completion (+ end-of-turn) + the full render after the end-of-turn token
    that ends the returned message: the first one after the base's own render (``own_len``
    ids, which ``full_ids`` begins with). None when there is none.

    Where the template renders the returned message as it does last (:func:`stitch_prompt`'s
    prefix-stable case) and its text holds no end-of-turn token (:func:`head_shape`), that is
    the head render's last end-of-turn token, and the ids are :func:`stitch_prompt`'s; the
    trailer is then reported as part of the suffix.
    """
    try:
        cut = full_ids.index(end_of_turn_id, own_len)
    except ValueError:
        return None
    return stitch_here(prompt_ids, completion_ids, end_of_turn_id, full_ids[cut + 1 :])


def stitch_here(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    end_of_turn_id: int,
    after_reply: Sequence[int],
) -> Stitched:
    """Base prompt + completion (+ end-of-turn) + ``after_reply``: the template's ids after the
    end-of-turn token that ends the returned message (the trailer, reported as part of the
    suffix, the appended messages and the generation prompt)."""
    base = _base(prompt_ids, completion_ids, end_of_turn_id)
    suffix = list(after_reply)
    return Stitched([*base, *suffix], len(base), [], suffix)


#: Request fields that do not reach the chat template (sampling, output and transport
#: options). Any other field — ``model``, ``tools``, ``chat_template_kwargs``, fields not
#: known here — is part of a :func:`head_shape`.
_NOT_RENDERED = frozenset(
    {
        "stream", "stream_options", "stream_interval", "temperature", "top_p", "top_k",
        "min_p", "seed", "n", "max_tokens", "max_completion_tokens", "min_tokens", "stop",
        "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "top_logprobs",
        "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
        "logit_bias", "bad_words", "allowed_token_ids", "skip_special_tokens",
        "spaces_between_special_tokens", "structured_outputs", "response_format",
        "parallel_tool_calls", "kv_transfer_params", "priority", "request_id", "cache_salt",
        "user", "metadata", "store", "service_tier",
    }
)  # fmt: skip


def _texts(value: Any) -> Iterator[str]:
    """Every text in a message: its string leaves, and those of JSON held in a string (tool-call
    arguments: the engine parses them, and the template writes them out again unescaped)."""
    if isinstance(value, str):
        yield value
        if value[:1] in ("{", "["):
            try:
                parsed = orjson.loads(value)
            except orjson.JSONDecodeError:
                return
            if not isinstance(parsed, str):
                yield from _texts(parsed)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def _opens_with_tag(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        content = next((p.get("text") for p in content if isinstance(p, dict)), None)
    return isinstance(content, str) and content.lstrip().startswith("<")


def head_shape(body: dict[str, Any], reply_index: int, end_of_turn: str) -> str | None:
    """What decides how the template renders the returned message (``messages[reply_index]``)
    and where its rendering ends:

    - the request fields that reach the template;
    - each of the message's fields by name, type and truthiness (templates tell an absent field
      from ``None``, ``""`` or ``[]``), its number of tool calls, and whether its text holds a
      closing tag (``</think>``, ``</tool_call>``: templates split on those);
    - the messages appended after it, in order, by role and by whether their text opens with a
      tag (Qwen3 tells a user turn from a tool result wrapped in ``<tool_response>``).

    None when the message's text (tool-call arguments included, parsed) holds the end-of-turn
    token itself: its rendering would then hold two.
    """
    messages = body["messages"]
    reply = messages[reply_index]
    texts = list(_texts(reply))
    if any(end_of_turn in text for text in texts):
        return None
    fields = {k: v for k, v in body.items() if k != "messages" and k not in _NOT_RENDERED}
    kept = sorted((str(k), type(v).__name__, bool(v)) for k, v in reply.items())
    calls = reply.get("tool_calls")
    tagged = any("</" in text for text in texts)
    after = [
        (str(m.get("role")) if isinstance(m, dict) else "?", _opens_with_tag(m))
        for m in messages[reply_index + 1 :]
    ]
    count = len(calls) if isinstance(calls, list) else -1
    shape = canonical_json([fields, kept, count, tagged, after])
    return hashlib.sha256(shape).hexdigest()[:32]
