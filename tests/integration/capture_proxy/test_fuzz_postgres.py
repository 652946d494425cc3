"""The schemathesis fuzzing of tests/unit/capture_proxy/test_fuzz_openapi.py on PostgreSQL.

PostgreSQL refuses what SQLite stores (NUL in text, strings longer than their column), so a
generated value that slips past the checks would be a 500 here and not there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.db import fresh_postgres_database
from tests.unit.capture_proxy.test_fuzz_openapi import (  # the same tests and fixtures
    client,
    test_every_route_answers_as_documented,
    test_the_fuzzed_store_holds_only_settled_calls,
)

pytestmark = pytest.mark.postgres

__all__ = [
    "client",
    "test_every_route_answers_as_documented",
    "test_the_fuzzed_store_holds_only_settled_calls",
]


@pytest.fixture(scope="module")
def fuzz_store() -> Iterator[str]:
    with fresh_postgres_database("capture_fuzz") as url:
        yield url
