"""orjson's reading of a JSON text where it is exactly ``json.loads``'s (issue 11).

orjson reads ~3× faster and to the same values, but for two things: it reads an integer literal
beyond 64 bits as a float (rounded), and it refuses what ``json.loads`` reads or refuses with its
own message (``NaN``, ``Infinity``, ``1e400``, lone surrogates, bad UTF-8). :func:`read_fast`
answers orjson's value unless it refused the text or read a whole float of 2⁶³ or more (such an
integer, or a float literal that is one); then :data:`UNREAD`, and the caller reads the text as it
always did. The look for such floats walks the parsed value, not the bytes (a look for 19-digit
runs in the raw bytes cost as much as orjson saved: docs/benchmarks.md, tenth session).

Used for request bodies (:mod:`capture_proxy.api.json_body`) and for the tool-call arguments that
stitching's canonical messages parse (:mod:`capture_proxy.message_chain`).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

#: What :func:`read_fast` answers when the text is to be read by ``json.loads``.
UNREAD: Final = object()
#: orjson reads an integer literal beyond 64 bits as a float of at least this magnitude.
_BEYOND_64_BITS = float(2**63)


def _maybe_rounded(value: Any) -> bool:
    """Whether orjson's reading holds a float that may be a rounded integer literal.

    (orjson's values are exactly dict, list, str, int, float, bool or None: ``type(…) is`` is
    exact here, and twice as fast over an agent's ~500 values as ``isinstance``.)"""
    kind = type(value)
    if kind is float:
        return abs(value) >= _BEYOND_64_BITS and value.is_integer()
    if kind is dict:
        items = value.values()
    elif kind is list:
        items = value
    else:
        return False
    for item in items:
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if _maybe_rounded(item):
            return True
    return False


def read_fast(data: bytes | str) -> Any:
    """orjson's value of ``data`` where it equals ``json.loads``'s, else :data:`UNREAD`."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return UNREAD
    return UNREAD if _maybe_rounded(value) else value
