"""The request body's JSON: exact where it is valid, a BadRequest that says why where not."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.api.json_body import parse_json
from capture_proxy.errors import BadRequest


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": [2**63 - 1, -(2**63)], "seed": 2**64 - 1},  # orjson's own range
        {"seed": 2**64, "big": -(2**63) - 1, "huge": 10**40},  # beyond it: read exactly too
        {"tiny": 1e-400, "max": 1.7976931348623157e308},  # (1e-400 is 0.0: finite)
        {"text": "snow ☃ and 😀", "t": 0.7, "z": -0.0, "e": 1e-300, "n": None, "b": [True]},
        {"id": "1234567890123456789012"},  # a long digit run in a string: the same value
        [1, "two", {"three": 3.5}],
    ],
)
def test_a_body_parses_to_the_value_the_standard_library_reads(value: object) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    parsed = parse_json(raw)
    assert parsed == value
    assert json.dumps(parsed) == json.dumps(value)  # ints stay ints, floats floats


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"t": NaN}', "NaN is not a JSON number"),
        (b'{"t": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"t": 1e400}', "beyond a float's range"),  # read as infinity by json.loads alone
        (b'{"t": -1.5e999}', "beyond a float's range"),
        (b'{"s": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"s": "\\ud800", "seed": 12345678901234567890}', "lone UTF-16 surrogate"),
        (b'{"s": "\xff"}', "not valid UTF-8"),
        (b'{"a": [1, 2}', "not valid JSON"),
    ],
)
def test_a_refused_body_says_why(raw: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_json(raw)
    assert says in refused.value.message


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)  # beyond 64 bits too
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=24,
)


@settings(max_examples=500, deadline=None)
@given(_VALUES, st.booleans())
def test_any_body_reads_as_json_loads_reads_it(value: object, ascii_only: bool) -> None:
    """orjson reads the body first; whatever it reads must be what ``json.loads`` reads."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()  # (st.text: no lone surrogates)
    parsed = parse_json(raw)
    expected = json.loads(raw)
    assert json.dumps(parsed, sort_keys=True) == json.dumps(expected, sort_keys=True)
