"""The bad-input tests of tests/unit/capture_proxy/test_bad_input.py on PostgreSQL.

PostgreSQL refuses more than SQLite (NUL in text, strings over a column's length): every case
must still be a 4xx before the store is touched, never a 500. Each test gets its own database,
built by the real migrations.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI

from tests.fixtures.db import fresh_postgres_database
from tests.unit.capture_proxy.test_bad_input import (  # the same tests and fixtures
    app,
    client,
    test_a_body_over_the_limit_is_413,
    test_an_agent_id_too_long_for_the_store_is_400,
    test_bad_openai_bodies_are_400_and_admit_nothing,
    test_bad_rest_requests_are_4xx_in_the_openai_shape,
    test_nan_in_rest_metadata_is_400,
    test_token_ids_inside_the_engine_vocabulary_are_served,
    test_unknown_and_closed_episodes,
)

pytestmark = pytest.mark.postgres

__all__ = [
    "app",
    "client",
    "test_a_body_over_the_limit_is_413",
    "test_an_agent_id_too_long_for_the_store_is_400",
    "test_bad_openai_bodies_are_400_and_admit_nothing",
    "test_bad_rest_requests_are_4xx_in_the_openai_shape",
    "test_nan_in_rest_metadata_is_400",
    "test_token_ids_inside_the_engine_vocabulary_are_served",
    "test_unknown_and_closed_episodes",
]


@pytest.fixture
def bad_input_store() -> Iterator[str]:
    with fresh_postgres_database("capture_bad") as url:
        yield url


def test_these_tests_run_on_postgresql(app: FastAPI) -> None:
    assert app.state.settings.store.url.startswith("postgresql+asyncpg://")
