"""Shared fixtures live in tests/fixtures/ as plugins, one module per real service.

Tiers: ``tests/unit`` (in-process, no sockets) and ``tests/integration`` (uvicorn, vLLM,
PostgreSQL, harness binaries, the wheel); each test is marked with its tier, so
``pytest -m unit`` runs the fast tier alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.engine",
    "tests.fixtures.db",
    "tests.fixtures.proxy",
    "tests.fixtures.browser",
]

_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.fspath).relative_to(_TESTS).parts[0]
        if tier in {"unit", "integration"}:
            item.add_marker(getattr(pytest.mark, tier))
