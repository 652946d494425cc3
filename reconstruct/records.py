"""Frozen, typed records of reconstruction: the episode bundle going in, rows and accounting out.

``parse_bundle`` is the only place a bundle dict (``capture-episode/v1``, docs/formats.md) is read;
everything downstream works on these records. Token arrays are read-only numpy arrays (int64 ids,
float64 logprobs), so records compare by identity (``eq=False``); use ``to_dict`` to compare
contents. Unknown keys in a bundle are tolerated (the writer may add fields); missing or ill-typed
known keys raise :class:`~capture_proxy.errors.InvalidBundle` naming the call and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from capture_proxy.errors import InvalidBundle

SCHEMA = "capture-episode/v1"

Role = Literal["policy", "compaction", "auxiliary"]
CallStatus = Literal["admitted", "completed", "failed", "cancelled"]
Mark = Literal["discarded", "accepted"]
Classification = Literal[
    "trained", "conditioning_only", "discarded_retry", "failed", "cancelled", "unresolved"
]
ROLES: frozenset[str] = frozenset(get_args(Role))
CALL_STATUSES: frozenset[str] = frozenset(get_args(CallStatus))
MARKS: frozenset[str] = frozenset(get_args(Mark))
CLASSIFICATIONS: tuple[str, ...] = get_args(Classification)
DEFAULT_TRAINABLE_ROLES: frozenset[str] = frozenset({"policy", "compaction"})

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def _frozen_ints(values: Any) -> IntArray:
    array = np.array(values, dtype=np.int64).reshape(-1)
    array.flags.writeable = False
    return array


def _frozen_floats(values: Any) -> FloatArray:
    array = np.array(values, dtype=np.float64).reshape(-1)
    array.flags.writeable = False
    return array


@dataclass(frozen=True, slots=True)
class Continuation:
    """How the proxy built a chat call's prompt (exact-token continuation, DESIGN §8).

    ``stitched``: the prompt is ``base_call_id``'s exact prompt + completion + the template's
    tokens for the new messages; otherwise ``reason`` says why it was rendered fresh.
    """

    stitched: bool
    reason: str | None = None
    base_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"stitched": self.stitched, "reason": self.reason, "base_call_id": self.base_call_id}


@dataclass(frozen=True, slots=True, eq=False)
class CallRecord:
    """One admitted model call of an episode (one choice of an ``n > 1`` request)."""

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
    continuation: Continuation | None = None  # absent from bundles without stitching records

    def to_dict(self) -> dict[str, Any]:
        out = {
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "status": self.status,
            "reward": self.reward,
            "calls": [call.to_dict() for call in self.calls],
        }


@dataclass(frozen=True, slots=True)
class Span:
    """One generation inside a row: ``input_ids[start:end]`` is the call's completion."""

    call_id: str
    start: int
    end: int
    owned: bool

    def to_dict(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "start": self.start, "end": self.end, "owned": self.owned}


@dataclass(frozen=True, slots=True, eq=False)
class Row:
    """One training row: one kept context endpoint (DESIGN §5.5)."""

    row_id: str
    episode_id: str
    group_id: str
    reward: float | None
    input_ids: IntArray  # [T]
    loss_mask: npt.NDArray[np.int8]  # [T], 1 exactly on owned positions
    behavior_logprobs: FloatArray  # [T], captured logprob on owned positions, 0.0 elsewhere
    spans: tuple[Span, ...]

    @property
    def endpoint_call_id(self) -> str:
        """The call whose prompt + completion this row is (its deepest span)."""
        return self.spans[-1].call_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "row_id": self.row_id,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "behavior_logprobs": self.behavior_logprobs.tolist(),
            "spans": [span.to_dict() for span in self.spans],
        }


@dataclass(frozen=True, slots=True)
class MarkNote:
    """A harness mark that changed nothing, and why."""

    call_id: str
    mark: Mark
    reason: Literal["call_not_completed", "has_kept_descendants", "nothing_to_override"]

    def to_dict(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "mark": self.mark, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Drift:
    """Re-tokenisation drift of one episode (issue 7's drift report, from the forest's view).

    ``continued``: completed calls whose prompt extends an earlier call's exact tokens (they
    have a parent); ``fresh_contexts``: completed calls that start a context (roots). From the
    proxy's records: ``stitched`` calls and fresh renders by ``reason`` (empty when the bundle
    carries no continuation records).
    """

    continued: int
    fresh_contexts: int
    stitched: int
    fresh_renders: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "continued": self.continued,
            "fresh_contexts": self.fresh_contexts,
            "stitched": self.stitched,
            "fresh_renders": dict(sorted(self.fresh_renders.items())),
        }


@dataclass(frozen=True, slots=True)
class Accounting:
    """Where every admitted call went (DESIGN §5.7).

    ``classification`` maps every call id to exactly one class; ``counts`` sums them. Tokens:
    ``row_tokens`` of the emitted rows, ``owned_tokens`` with loss, ``reference_tokens`` of the
    per-call layout (prompt + completion of every trained call).
    """

    episode_id: str
    n_calls: int
    classification: Mapping[str, Classification]
    ambiguous_parent: tuple[str, ...]
    ineffective_marks: tuple[MarkNote, ...]
    empty_completions: tuple[str, ...]
    rows: int
    row_tokens: int
    owned_tokens: int
    reference_tokens: int
    drift: Drift

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(CLASSIFICATIONS, 0)
        for cls in self.classification.values():
            counts[cls] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "n_calls": self.n_calls,
            "counts": self.counts,
            "classification": dict(sorted(self.classification.items())),
            "ambiguous_parent": list(self.ambiguous_parent),
            "ineffective_marks": [note.to_dict() for note in self.ineffective_marks],
            "empty_completions": list(self.empty_completions),
            "rows": self.rows,
            "row_tokens": self.row_tokens,
            "owned_tokens": self.owned_tokens,
            "reference_tokens": self.reference_tokens,
            "drift": self.drift.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Reconstruction:
    """Rows plus accounting of one episode; ``parents`` maps each completed call to its parent."""

    rows: tuple[Row, ...]
    accounting: Accounting
    parents: Mapping[str, str | None]


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
    return _frozen_ints(array)


def _logprobs(value: Any, key: str, where: str) -> FloatArray:
    array = _as_array(value, key, where, "numbers")
    if array.size and (array.dtype.kind not in "iuf" or not bool(np.isfinite(array).all())):
        raise InvalidBundle(f"{where}: field {key!r} must hold finite numbers only", param=key)
    return _frozen_floats(array)


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
    completed_seq = _int(data.get("completed_seq"), "completed_seq", where, nullable=True)
    prompt = _token_ids(data.get("prompt_token_ids", []), "prompt_token_ids", where)
    completion = _token_ids(data.get("completion_token_ids", []), "completion_token_ids", where)
    logprobs = _logprobs(data.get("completion_logprobs", []), "completion_logprobs", where)
    assert admitted_seq is not None
    if status == "completed":
        for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
            _require(data, key, where)
        if completed_seq is None:
            raise InvalidBundle(f"{where}: completed call without completed_seq")
        if completed_seq <= admitted_seq:
            raise InvalidBundle(
                f"{where}: completed_seq {completed_seq} is not after admitted_seq {admitted_seq}"
            )
        if len(logprobs) != len(completion):
            raise InvalidBundle(
                f"{where}: {len(logprobs)} completion_logprobs for "
                f"{len(completion)} completion_token_ids",
                param="completion_logprobs",
            )
    return CallRecord(
        call_id=call_id,
        agent_id=_str(data.get("agent_id"), "agent_id", where, nullable=True),
        parent_agent_id=_str(data.get("parent_agent_id"), "parent_agent_id", where, nullable=True),
        role=_choice(_require(data, "role", where), "role", where, ROLES, False),
        status=status,
        mark=_choice(data.get("mark"), "mark", where, MARKS, True),
        admitted_seq=admitted_seq,
        completed_seq=completed_seq,
        finish_reason=_str(data.get("finish_reason"), "finish_reason", where, nullable=True),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        continuation=_continuation(data.get("continuation"), where),
    )


def _continuation(value: Any, where: str) -> Continuation | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("stitched"), bool):
        raise InvalidBundle(
            f"{where}: field 'continuation' must be an object with a boolean 'stitched'",
            param="continuation",
        )
    return Continuation(
        stitched=value["stitched"],
        reason=_str(value.get("reason"), "continuation.reason", where, nullable=True),
        base_call_id=_str(
            value.get("base_call_id"), "continuation.base_call_id", where, nullable=True
        ),
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
    seen: set[str] = set()
    for call in calls:
        if call.call_id in seen:
            raise InvalidBundle(f"bundle: duplicate call_id {call.call_id!r}", param="call_id")
        seen.add(call.call_id)
    return EpisodeBundle(
        episode_id=episode_id,
        group_id=group_id,
        status=status,
        reward=None if reward is None else float(reward),
        calls=calls,
    )
