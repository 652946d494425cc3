"""Real processes for the reliability tests: the fake engine as a server of its own, a fresh
PostgreSQL database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.db import fresh_postgres_database
from tests.support import processes
from tests.support.processes import Process


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Process]:
    """The fake engine (tests/support/stub_engine.py) running; killed after the test."""
    process = processes.stub_engine(tmp_path).start()
    yield process
    process.kill()


@pytest.fixture
def postgres_store() -> Iterator[str]:
    with fresh_postgres_database("capture_reliability") as url:
        yield url
