"""Strict JSON for request bodies: UTF-8, no NaN/Infinity, no lone surrogates, no NUL in labels.

The standard library's ``json.loads`` accepts ``NaN`` and ``Infinity`` and reads a number such
as ``1e400`` as infinity (none of which a JSON encoder downstream will write back: the answer
would be a 500), and ``"\\ud800"`` escapes that decode to a lone surrogate (which cannot be
encoded as UTF-8 to the engine or the store). All are the client's fault and get a 400 here,
before anything is admitted.

A body is read by orjson first where its reading is exactly ``json.loads``'s
(:mod:`capture_proxy.exact_json`: an agent's 50 KB request, dense with escaped newlines, ~1.8×
faster); else by ``json.loads`` as before: exact values, the same errors.

``json.loads``'s surrogate walk runs only when the raw text holds a ``\\uD8``…``\\uDF``
escape.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import Request

from capture_proxy.errors import BadRequest
from capture_proxy.exact_json import UNREAD, read_fast

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


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or BadRequest saying what is wrong with it."""
    value = read_fast(raw)
    if value is not UNREAD:
        return value
    # (orjson refused it, or may have rounded an integer: the standard library's reading)
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
