"""The episode bundle (``capture-episode/v1``, docs/formats.md): typed records, parse, serialise.

One home for the format: the store serialises bundles through :meth:`EpisodeBundle.to_dict`, and
:func:`parse_bundle` is the only place a bundle dict is read; reconstruction works on the records.
Token arrays are read-only numpy arrays (int64 ids, float64 logprobs), so records compare by
identity (``eq=False``); use ``to_dict`` to compare contents. Unknown keys in a bundle are
tolerated (the writer may add fields); missing or ill-typed known keys raise
:class:`~capture_contracts.errors.InvalidBundle` naming the call and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from capture_contracts.errors import InvalidBundle
from capture_contracts.vocabulary import (
    CALL_STATUSES,
    CONSTRAINTS,
    CONTINUATION_MODES,
    MARKS,
    ROLES,
    CallStatus,
    Constraint,
    ContinuationMode,
    Mark,
    Role,
)

SCHEMA = "capture-episode/v1"

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def frozen_ints(values: Any) -> IntArray:
    array = np.array(values, dtype=np.int64).reshape(-1)
    array.flags.writeable = False
    return array


def frozen_floats(values: Any) -> FloatArray:
    array = np.array(values, dtype=np.float64).reshape(-1)
    array.flags.writeable = False
    return array


_RECORD_EXTRAS = (
    "mode",
    "messages",
    "prefix_hash",
    "tools_hash",
    "base_len",
    "suffix_len",
    "renders",
    "render_len",
    "render_digest",
    "prefilled",
)


@dataclass(frozen=True, slots=True)
class ContinuationRecord:
    """How the proxy built a chat call's prompt (exact-token continuation), one per call.

    ``stitched``: the prompt is ``base_call_id``'s exact prompt + completion + the template's
    tokens for the new messages; otherwise ``reason`` (a ``FallbackReason``) says why it was
    rendered fresh, and ``base_call_id`` names the call it extends at message level, if any.
    ``messages``, ``prefix_hash`` and ``tools_hash`` let later calls of the agent find this one;
    ``base_len`` and ``suffix_len`` size a stitched prompt's two parts; ``renders`` is how many
    of the engine's renders the stitch took (0: rendered in the proxy, 1: the full render alone,
    2: with the head render),
    and ``render_len`` / ``render_digest`` (a stitched call: its prompt is not the engine's
    render of its request) name that render, which the next call's render must begin with for
    it to take one. ``prefilled``: the request did not end at a generation prompt
    (``continue_final_message``, or ``add_generation_prompt`` false), so its render ends inside
    a message and no later call is cut on it.
    """

    stitched: bool
    reason: str | None = None
    base_call_id: str | None = None
    mode: ContinuationMode | None = None
    messages: int | None = None
    prefix_hash: str | None = None
    tools_hash: str | None = None
    base_len: int | None = None
    suffix_len: int | None = None
    renders: int | None = None
    render_len: int | None = None
    render_digest: str | None = None
    prefilled: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stitched": self.stitched,
            "reason": self.reason,
            "base_call_id": self.base_call_id,
        }
        for key in _RECORD_EXTRAS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True, slots=True, eq=False)
class CallRecord:
    """One admitted model call of an episode (one choice of an ``n > 1`` request).

    ``weight_version`` is the policy version that served the call (the proxy's record of the
    engine's weights at admission; None in bundles from before versions were recorded).
    ``constraint`` names the grammar that constrained the call's decoding, if any: the engine
    masked its logits at *every* step of such a call, so every completion token is constrained
    and its logprob is one of the masked distribution, not of the policy (:attr:`constrained`).
    """

    call_id: str
    agent_id: str | None
    parent_agent_id: str | None
    role: Role
    status: CallStatus
    mark: Mark | None
    admitted_seq: int
    completed_seq: int | None
    finish_reason: str | None
    prompt_token_ids: IntArray
    completion_token_ids: IntArray
    completion_logprobs: FloatArray
    continuation: ContinuationRecord | None = None  # absent from bundles without stitching
    error: str | None = None  # why a call failed or was cancelled (informative)
    weight_version: int | None = None
    constraint: Constraint | None = None

    @property
    def constrained(self) -> bool:
        """True when every completion token was sampled under a grammar's mask."""
        return self.constraint is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "call_id": self.call_id,
            "agent_id": self.agent_id,
            "parent_agent_id": self.parent_agent_id,
            "role": self.role,
            "status": self.status,
            "mark": self.mark,
            "admitted_seq": self.admitted_seq,
            "completed_seq": self.completed_seq,
            "finish_reason": self.finish_reason,
            "prompt_token_ids": self.prompt_token_ids.tolist(),
            "completion_token_ids": self.completion_token_ids.tolist(),
            "completion_logprobs": self.completion_logprobs.tolist(),
        }
        if self.error is not None:
            out["error"] = self.error
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.constraint is not None:
            out["constraint"] = self.constraint
        if self.continuation is not None:
            out["continuation"] = self.continuation.to_dict()
        return out


@dataclass(frozen=True, slots=True, eq=False)
class EpisodeBundle:
    """One episode with every admitted call (``capture-episode/v1``)."""

    episode_id: str
    group_id: str
    status: str
    reward: float | None
    calls: tuple[CallRecord, ...]
    metadata: Mapping[str, Any] | None = field(default=None)  # informative

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "status": self.status,
            "reward": self.reward,
        }
        if self.metadata is not None:
            out["metadata"] = dict(self.metadata)
        out["calls"] = [call.to_dict() for call in self.calls]
        return out


# --------------------------------------------------------------------------- parsing


def _require(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise InvalidBundle(f"{where}: missing field {key!r}", param=key)
    return data[key]


def _str(value: Any, key: str, where: str, *, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value:
        kind = "a non-empty string" + (" or null" if nullable else "")
        raise InvalidBundle(f"{where}: field {key!r} must be {kind}, got {value!r}", param=key)
    return value


def _req_str(value: Any, key: str, where: str) -> str:
    out = _str(value, key, where)
    assert out is not None
    return out


def _flag(value: Any, key: str, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise InvalidBundle(f"{where}: field {key!r} must be a boolean or null", param=key)


def _int(value: Any, key: str, where: str, *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        kind = "a non-negative integer" + (" or null" if nullable else "")
        raise InvalidBundle(f"{where}: field {key!r} must be {kind}, got {value!r}", param=key)
    return value


def _choice(value: Any, key: str, where: str, allowed: frozenset[str], nullable: bool) -> Any:
    if value is None and nullable:
        return None
    if value not in allowed:
        raise InvalidBundle(
            f"{where}: field {key!r} must be one of {sorted(allowed)}"
            + (" or null" if nullable else "")
            + f", got {value!r}",
            param=key,
        )
    return value


def _as_array(value: Any, key: str, where: str, what: str) -> npt.NDArray[Any]:
    if not isinstance(value, list | tuple | np.ndarray):
        raise InvalidBundle(f"{where}: field {key!r} must be a list of {what}", param=key)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidBundle(f"{where}: field {key!r} must be a flat list of {what}") from exc
    if array.ndim != 1:
        raise InvalidBundle(f"{where}: field {key!r} must be a flat list of {what}", param=key)
    return array


def _token_ids(value: Any, key: str, where: str) -> IntArray:
    array = _as_array(value, key, where, "token ids")
    if array.size and (
        array.dtype.kind not in "iu" or int(array.min()) < 0 or int(array.max()) >= 2**63
    ):
        bad = next(
            (t for t in value if isinstance(t, bool) or not isinstance(t, int) or t < 0),
            None,
        )
        shown = "an out-of-range value" if bad is None else repr(bad)
        raise InvalidBundle(
            f"{where}: field {key!r} holds {shown}, not a non-negative integer token id",
            param=key,
        )
    return frozen_ints(array)


def _logprobs(value: Any, key: str, where: str) -> FloatArray:
    array = _as_array(value, key, where, "numbers")
    if array.size and (array.dtype.kind not in "iuf" or not bool(np.isfinite(array).all())):
        raise InvalidBundle(f"{where}: field {key!r} must hold finite numbers only", param=key)
    return frozen_floats(array)


def parse_call(data: Any, index: int) -> CallRecord:
    """One call dict → :class:`CallRecord`, or :class:`InvalidBundle` naming what is wrong."""
    if not isinstance(data, Mapping):
        raise InvalidBundle(f"calls[{index}] must be an object, got {type(data).__name__}")
    call_id = _req_str(_require(data, "call_id", f"calls[{index}]"), "call_id", f"calls[{index}]")
    where = f"call {call_id!r} (calls[{index}])"
    status: CallStatus = _choice(
        _require(data, "status", where), "status", where, CALL_STATUSES, False
    )
    admitted_seq = _int(_require(data, "admitted_seq", where), "admitted_seq", where)
    assert admitted_seq is not None
    if status == "completed":
        for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
            _require(data, key, where)
    call = CallRecord(
        call_id=call_id,
        agent_id=_str(data.get("agent_id"), "agent_id", where, nullable=True),
        parent_agent_id=_str(data.get("parent_agent_id"), "parent_agent_id", where, nullable=True),
        role=_choice(_require(data, "role", where), "role", where, ROLES, False),
        status=status,
        mark=_choice(data.get("mark"), "mark", where, MARKS, True),
        admitted_seq=admitted_seq,
        completed_seq=_int(data.get("completed_seq"), "completed_seq", where, nullable=True),
        finish_reason=_str(data.get("finish_reason"), "finish_reason", where, nullable=True),
        prompt_token_ids=_token_ids(data.get("prompt_token_ids", []), "prompt_token_ids", where),
        completion_token_ids=_token_ids(
            data.get("completion_token_ids", []), "completion_token_ids", where
        ),
        completion_logprobs=_logprobs(
            data.get("completion_logprobs", []), "completion_logprobs", where
        ),
        continuation=parse_continuation(data.get("continuation"), where),
        error=data.get("error") if isinstance(data.get("error"), str) else None,
        weight_version=_int(data.get("weight_version"), "weight_version", where, nullable=True),
        constraint=_choice(data.get("constraint"), "constraint", where, CONSTRAINTS, True),
    )
    check_call(call, where)
    return call


def check_call(call: CallRecord, where: str | None = None) -> None:
    """The invariants of a completed call: ordered counters, one logprob per sampled token."""
    if call.status != "completed":
        return
    where = where or f"call {call.call_id!r}"
    if call.completed_seq is None:
        raise InvalidBundle(f"{where}: completed call without completed_seq")
    if call.completed_seq <= call.admitted_seq:
        raise InvalidBundle(
            f"{where}: completed_seq {call.completed_seq} is not after admitted_seq "
            f"{call.admitted_seq}"
        )
    if len(call.completion_logprobs) != len(call.completion_token_ids):
        raise InvalidBundle(
            f"{where}: {len(call.completion_logprobs)} completion_logprobs for "
            f"{len(call.completion_token_ids)} completion_token_ids",
            param="completion_logprobs",
        )


def parse_continuation(value: Any, where: str = "call") -> ContinuationRecord | None:
    """A stored or bundled continuation object → :class:`ContinuationRecord` (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("stitched"), bool):
        raise InvalidBundle(
            f"{where}: field 'continuation' must be an object with a boolean 'stitched'",
            param="continuation",
        )

    def text(key: str) -> str | None:
        return _str(value.get(key), f"continuation.{key}", where, nullable=True)

    def count(key: str) -> int | None:
        return _int(value.get(key), f"continuation.{key}", where, nullable=True)

    mode = value.get("mode")
    return ContinuationRecord(
        stitched=value["stitched"],
        reason=text("reason"),
        base_call_id=text("base_call_id"),
        mode=mode if mode in CONTINUATION_MODES else None,
        messages=count("messages"),
        prefix_hash=text("prefix_hash"),
        tools_hash=text("tools_hash"),
        base_len=count("base_len"),
        suffix_len=count("suffix_len"),
        renders=count("renders"),
        render_len=count("render_len"),
        render_digest=text("render_digest"),
        prefilled=_flag(value.get("prefilled"), "continuation.prefilled", where),
    )


def parse_bundle(data: Any) -> EpisodeBundle:
    """A parsed ``capture-episode/v1`` JSON object → :class:`EpisodeBundle`.

    Raises :class:`InvalidBundle` for a wrong schema, missing or ill-typed fields, duplicate call
    ids, ``completed_seq`` not after ``admitted_seq``, or logprob/token length mismatches.
    """
    if not isinstance(data, Mapping):
        raise InvalidBundle(f"bundle must be a JSON object, got {type(data).__name__}")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise InvalidBundle(f"bundle schema must be {SCHEMA!r}, got {schema!r}", param="schema")
    episode_id = _req_str(_require(data, "episode_id", "bundle"), "episode_id", "bundle")
    group_id = _req_str(_require(data, "group_id", "bundle"), "group_id", "bundle")
    status = _req_str(_require(data, "status", "bundle"), "status", "bundle")
    reward = data.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        raise InvalidBundle(f"bundle: reward must be a finite number or null, got {reward!r}")
    raw_calls = _require(data, "calls", "bundle")
    if not isinstance(raw_calls, list | tuple):
        raise InvalidBundle("bundle: field 'calls' must be a list", param="calls")
    calls = tuple(parse_call(raw, index) for index, raw in enumerate(raw_calls))
    _check_unique(calls)
    metadata = data.get("metadata")
    return EpisodeBundle(
        episode_id=episode_id,
        group_id=group_id,
        status=status,
        reward=None if reward is None else float(reward),
        calls=calls,
        metadata=dict(metadata) if isinstance(metadata, Mapping) else None,
    )


def check_bundle(bundle: EpisodeBundle) -> EpisodeBundle:
    """Check a typed bundle (e.g. one the store built) as :func:`parse_bundle` checks a dict."""
    for call in bundle.calls:
        check_call(call)
    _check_unique(bundle.calls)
    return bundle


def _check_unique(calls: tuple[CallRecord, ...]) -> None:
    seen: set[str] = set()
    for call in calls:
        if call.call_id in seen:
            raise InvalidBundle(f"bundle: duplicate call_id {call.call_id!r}", param="call_id")
        seen.add(call.call_id)
