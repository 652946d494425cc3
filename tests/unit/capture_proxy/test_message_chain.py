"""The message level of stitching: the canonical form of a message and the hash chain."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.message_chain import canonical_json, canonical_message, chain, tools_hash

SYSTEM: dict[str, Any] = {"role": "system", "content": "sys"}
USER: dict[str, Any] = {"role": "user", "content": "count"}
CALL = {"id": "x1", "type": "function", "function": {"name": "look", "arguments": '{"shelf": 1}'}}
REPLY: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [CALL]}


def test_canonical_form_ignores_ids_and_json_spacing() -> None:
    edited = {**CALL, "id": "other", "function": {"name": "look", "arguments": '{"shelf":1}'}}
    assert canonical_message(REPLY) == canonical_message({**REPLY, "tool_calls": [edited]})
    assert canonical_message({"role": "assistant", "content": None}) == canonical_message(
        {"role": "assistant", "content": ""}
    )
    assert canonical_message({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == (
        canonical_message({"role": "user", "content": "hi"})
    )
    assert chain([USER]) != chain([{"role": "user", "content": "other"}])


def _reference_chain(messages: list[dict[str, Any]]) -> list[str]:
    """The hash chain as the first release computed it (stored hashes must not change)."""
    hashes = [hashlib.sha256(b"").hexdigest()[:32]]
    for message in messages:
        text = json.dumps(canonical_message(message), sort_keys=True, separators=(",", ":"))
        hashes.append(hashlib.sha256((hashes[-1] + text).encode()).hexdigest()[:32])
    return hashes


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # beyond 64 bits too
    | st.floats()  # NaN and infinities included
    | st.text(st.characters(exclude_categories=())),  # control, DEL, non-ASCII, lone surrogates
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=24,
)


@settings(max_examples=600, deadline=None)
@given(_JSON)
def test_canonical_json_is_json_dumps_byte_for_byte(value: Any) -> None:
    expected = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    assert canonical_json(value) == expected


@settings(max_examples=400, deadline=None)
@given(_JSON, st.booleans())
def test_tool_arguments_read_as_json_loads_reads_them(value: Any, spaced: bool) -> None:
    """orjson reads them where it reads the same values (not integers beyond 64 bits)."""
    text = json.dumps(value, indent=1 if spaced else None)
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}
    [call] = canonical_message(message)["tool_calls"]
    expected = json.dumps(json.loads(text), sort_keys=True)
    assert json.dumps(call["arguments"], sort_keys=True) == expected
    assert type(call["arguments"]) is type(json.loads(text))


def test_hash_chain_is_the_stored_one() -> None:
    """Messages whose bytes orjson alone would write otherwise: floats in tool arguments, a
    64-bit+ integer, DEL, non-ASCII text inside and beyond the BMP; and a pinned value."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Tu es prudent — “citations” ✓ 😀\x7f\x1f"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"function": {"name": "f", "arguments": '{"x": 1e-05, "n": 123456789012345678901}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok", "name": "f"},
        {"role": "user", "content": "ASCII but DEL: \x7f"},
        SYSTEM,
    ]
    assert chain(messages) == _reference_chain(messages)
    assert chain([SYSTEM, USER])[-1] == "a63afab3298019543eb1bafa5f3443c6"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"minimum": 0.5}}}]
    expected = json.dumps(tools, sort_keys=True, separators=(",", ":")).encode()
    assert tools_hash({"tools": tools}) == hashlib.sha256(expected).hexdigest()[:32]
