"""Strict JSON for request bodies: UTF-8, no NaN/Infinity, no lone surrogates, no NUL in labels.

The standard library's ``json.loads`` accepts ``NaN`` and ``Infinity`` and reads a number such
as ``1e400`` as infinity (none of which a JSON encoder downstream will write back: the answer
would be a 500), and ``"\\ud800"`` escapes that decode to a lone surrogate (which cannot be
encoded as UTF-8 to the engine or the store). All are the client's fault and get a 400 here,
before anything is admitted.

A body is read by orjson first (an agent's 50 KB request, dense with escaped newlines: ~3.5×
faster than ``json.loads``). It reads the same values but for integers beyond 64 bits, which it
reads as floats, and it refuses what ``json.loads`` reads or refuses with its own message
(``NaN``, ``1e400``, lone surrogates, invalid UTF-8). So a body orjson refuses, or in which it
read a whole float of 2⁶³ or more (such an integer, or a float literal that is one: read again,
it is the same), is read by ``json.loads`` as before: exact values, the same errors. The walk
that looks for such floats is over the parsed value, not the bytes (the tenth session's look for
19-digit runs in the raw bytes cost as much as orjson saved on plain prose).

``json.loads``'s surrogate walk runs only when the raw text holds a ``\\uD8``…``\\uDF``
escape.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson
from starlette.requests import Request

from capture_proxy.errors import BadRequest

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the request body holds {text}, a number beyond a float's range")
    return value


def check_json_value(value: Any, where: str = "body") -> None:
    """Every string encodes as UTF-8 and every float is finite (raises BadRequest)."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{path}: a string holds a lone UTF-16 surrogate") from None
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise BadRequest(f"{path}: {item} is not a JSON number")
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path))
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


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


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or BadRequest saying what is wrong with it."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # (the standard library's reading says what is wrong, or reads it)
    else:
        if not _maybe_rounded(value):
            return value
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc.reason}") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(text):
        check_json_value(value)
    return value


async def read_json(request: Request) -> Any:
    return parse_json(await request.body())


def check_label(value: str, name: str, max_chars: int = 200) -> None:
    """A short identifier that is stored as a string column (PostgreSQL refuses NUL)."""
    if len(value) > max_chars:
        raise BadRequest(f"`{name}` is longer than {max_chars} characters", param=name)
    if "\x00" in value:
        raise BadRequest(f"`{name}` holds a NUL character", param=name)
