"""parse_bundle: strict typed records with clear InvalidBundle messages."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from capture_contracts.errors import InvalidBundle
from reconstruct import parse_bundle
from tests.support.builders import EpisodeBuilder


def _bundle() -> dict[str, Any]:
    b = EpisodeBuilder("ep-r")
    full = b.call("c1", [1, 2, 3], agent="a")
    b.call("c2", [*full, 9], agent="a")
    b.admit("c3", [5])
    b.end("c3", "failed")
    return b.bundle()


def test_round_trip() -> None:
    bundle = _bundle()
    parsed = parse_bundle(bundle)
    assert parsed.to_dict() == bundle
    assert parsed.calls[0].prompt_token_ids.tolist() == [1, 2, 3]
    assert not parsed.calls[0].prompt_token_ids.flags.writeable
    with pytest.raises(AttributeError):
        parsed.calls[0].call_id = "x"  # type: ignore[misc]


def test_unknown_keys_are_tolerated() -> None:
    bundle = _bundle()
    bundle["exported_at"] = "now"
    bundle["calls"][0]["usage"] = {"prompt_tokens": 3}
    assert len(parse_bundle(bundle).calls) == 3


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    bundle = copy.deepcopy(_bundle())
    target: Any = bundle
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return bundle


_DELETE = object()

BAD: list[tuple[tuple[Any, ...], Any, str]] = [
    (("schema",), "capture-episode/v0", "schema must be"),
    (("episode_id",), _DELETE, "missing field 'episode_id'"),
    (("group_id",), 7, "'group_id' must be a non-empty string"),
    (("reward",), math.nan, "reward must be a finite number"),
    (("reward",), True, "reward must be a finite number"),
    (("calls",), {"c1": {}}, "'calls' must be a list"),
    (("calls", 0), [1], "calls[0] must be an object"),
    (("calls", 0, "call_id"), _DELETE, "calls[0]: missing field 'call_id'"),
    (("calls", 1, "call_id"), "c1", "duplicate call_id 'c1'"),
    (("calls", 0, "role"), "critic", "'role' must be one of"),
    (("calls", 0, "status"), "done", "'status' must be one of"),
    (("calls", 0, "mark"), "maybe", "'mark' must be one of"),
    (("calls", 0, "agent_id"), "", "'agent_id' must be a non-empty string or null"),
    (("calls", 0, "admitted_seq"), -1, "'admitted_seq' must be a non-negative integer"),
    (("calls", 0, "admitted_seq"), 1.0, "'admitted_seq' must be a non-negative integer"),
    (("calls", 0, "completed_seq"), None, "completed call without completed_seq"),
    (("calls", 0, "completed_seq"), 1, "is not after admitted_seq"),
    (("calls", 0, "prompt_token_ids"), [1, -2], "holds -2, not a non-negative integer"),
    (("calls", 0, "prompt_token_ids"), [1, 2.0], "not a non-negative integer token id"),
    (("calls", 0, "prompt_token_ids"), [True], "holds True"),
    (("calls", 0, "prompt_token_ids"), [2**70], "holds an out-of-range value"),
    (("calls", 0, "prompt_token_ids"), [2**64 - 1], "holds an out-of-range value"),
    (("calls", 0, "prompt_token_ids"), "1 2 3", "must be a list of token ids"),
    (("calls", 0, "prompt_token_ids"), [[1, 2]], "flat list"),
    (("calls", 0, "completion_token_ids"), _DELETE, "missing field 'completion_token_ids'"),
    (("calls", 0, "completion_logprobs"), [-0.5], "1 completion_logprobs for 3"),
    (("calls", 0, "completion_logprobs"), [-0.5, math.inf, -1.0], "finite numbers only"),
    (("calls", 0, "completion_logprobs"), [-0.5, "x", -1.0], "finite numbers only"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD)
def test_invalid_bundles_name_the_problem(path: tuple[Any, ...], value: Any, message: str) -> None:
    with pytest.raises(InvalidBundle) as info:
        parse_bundle(_set(path, value))
    assert message in str(info.value)


def test_not_an_object() -> None:
    with pytest.raises(InvalidBundle, match="must be a JSON object"):
        parse_bundle([])


def test_failed_call_may_lack_tokens() -> None:
    bundle = _bundle()
    for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
        del bundle["calls"][2][key]
    assert parse_bundle(bundle).calls[2].prompt_token_ids.tolist() == []
