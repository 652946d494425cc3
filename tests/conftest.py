"""Shared fixtures live in tests/fixtures/ as plugins, one module per real service."""

pytest_plugins = [
    "tests.fixtures.engine",
    "tests.fixtures.db",
    "tests.fixtures.proxy",
]
