"""Messages compared in a normalised form, through a hash chain (stitching's message level).

``h_0 = H("")``, ``h_k = H(h_{k-1} + canon(m_k))``: a recorded call stores two hashes,
``prefix_hash`` (its own messages) and ``reply_hash`` (its messages plus the assistant message
the proxy returned), and a later request extends it when its own chain holds its reply hash
(:mod:`capture_proxy.stitch`). ``canon`` keeps what of a message reaches the model
(:func:`canonical_message`), written as fixed bytes (:func:`canonical_json`): the hashes are
stored with each call and compared across processes and releases.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import orjson

from capture_proxy.exact_json import UNREAD, read_fast

_EMPTY = hashlib.sha256(b"").hexdigest()[:32]
#: What ``json.dumps`` escapes (``ensure_ascii``) and orjson writes as it is: DEL and non-ASCII.
_UNESCAPED = re.compile("[\x7f-\U0010ffff]")


def _escape(match: re.Match[str]) -> str:
    """One character as ``json.dumps`` escapes it: ``\\uXXXX``, a surrogate pair beyond the BMP."""
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}"


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    items: Any
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return False
    for item in items:  # noqa: SIM110 (a plain loop: no generator per container)
        if not isinstance(item, str) and _has_float(item):  # (text: most of a message)
            return True
    return False


def canonical_json(value: Any, *, floats: bool | None = None) -> bytes:
    """``json.dumps(value, sort_keys=True, separators=(",", ":")).encode()``, byte for byte.

    The hashes built on these bytes are stored with each call and compared across processes and
    releases, so the bytes never change; orjson writes them ~10× faster where it writes the same
    ones. It does not for floats (``1e-05`` is ``0.00001`` there), integers beyond 64 bits and
    lone surrogates (it refuses them): those take ``json.dumps``. What it writes unescaped — DEL
    and non-ASCII characters, which ``json.dumps`` escapes — is escaped afterwards, as
    ``json.dumps`` does (``test_message_chain.py`` holds the two to the same bytes on random
    values).
    On an OpenCode-sized request (61 messages, 50 KB) the hash chain was ~20 % of a call's CPU.
    ``floats``: whether ``value`` may hold a float (None: look).
    """
    if floats is None:
        floats = _has_float(value)
    if not floats:
        try:
            out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            pass
        else:
            if out.isascii() and b"\x7f" not in out:
                return out
            return _UNESCAPED.sub(_escape, out.decode()).encode()
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# -- normalised messages and the hash chain -------------------------------------------------


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in value
    ):
        return "".join(str(p.get("text", "")) for p in value)
    return json.dumps(value, sort_keys=True)


def _arguments(value: Any) -> Any:
    """Tool-call arguments as ``json.loads`` reads them (the text itself when it is not JSON),
    by orjson where its reading is the same (:mod:`capture_proxy.exact_json`)."""
    if not isinstance(value, str):
        return value
    parsed = read_fast(value)
    if parsed is not UNREAD:
        return parsed
    try:
        return json.loads(value)
    except ValueError:
        return value


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """What of a message reaches the model: role, text, tool calls (name + parsed arguments).

    Tool-call ids and reasoning fields are left out: harnesses regenerate or drop them, and the
    stitched prompt keeps the model's own sampled tokens for the assistant turn anyway.
    """
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": _content(message.get("content")),
    }
    if message.get("name"):
        out["name"] = message["name"]
    if message.get("role") == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append(
            {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}
        )
    if calls:
        out["tool_calls"] = calls
    return out


def _message_has_float(canonical: dict[str, Any]) -> bool:
    """Whether a canonical message holds a float: its content and tool-call id are text, so
    only its role, name or tool calls can (a client's odd role or name, tool arguments)."""
    for key in ("role", "name", "tool_calls"):
        value = canonical.get(key)
        if value is not None and not isinstance(value, str) and _has_float(value):
            return True
    return False


def chain_next(previous: str, message: dict[str, Any]) -> str:
    canonical = canonical_message(message)
    text = canonical_json(canonical, floats=_message_has_float(canonical))
    return hashlib.sha256(previous.encode() + text).hexdigest()[:32]


def chain(messages: Sequence[dict[str, Any]]) -> list[str]:
    """``[h_0, h_1, …, h_m]`` for ``m`` messages."""
    hashes = [_EMPTY]
    for message in messages:
        hashes.append(chain_next(hashes[-1], message))
    return hashes


def tools_hash(body: dict[str, Any]) -> str:
    """The tool list, as rendered into the system turn.

    ``tool_choice`` is left out: it does not change the prompt (vLLM renders the tools whatever
    the choice, unless started with ``--exclude-tools-when-tool-choice-none``), only decoding, so
    a call that keeps the tools with ``tool_choice: "none"`` (a compaction call keeping the
    prompt cache) still extends the agent's tokens.
    """
    return hashlib.sha256(canonical_json(body.get("tools") or [])).hexdigest()[:32]
