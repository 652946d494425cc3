"""Strict JSON for request bodies: UTF-8, no NaN/Infinity, no lone surrogates, no NUL in labels.

The standard library's ``json.loads`` accepts ``NaN`` and ``Infinity`` (which no JSON encoder
downstream will write back: the answer would be a 500) and ``"\\ud800"`` escapes that decode to
a lone surrogate (which cannot be encoded as UTF-8 to the engine or the store). Both are the
client's fault and get a 400 here, before anything is admitted.

orjson parses first (a harness's 50 kB body in a fraction of the standard library's time); it
refuses all of the above by itself. Where it is not exact — integers beyond 64 bits, which it
reads as floats (looked for as runs of 19 digits in the raw bytes) — or where it refuses a body,
the standard library parses it and the error, if any, is its own. That path walks the value for
the surrogates and non-finite numbers it lets through (a number such as ``1e400`` overflows to
infinity there).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson
from starlette.requests import Request

from capture_proxy.errors import BadRequest

#: A number orjson might not read exactly (beyond 64 bits: 19 digits and more).
_LONG_NUMBER = re.compile(rb"\d{19}")


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


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
    if _LONG_NUMBER.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library's parse says what is wrong (or reads it exactly)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc.reason}") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
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
