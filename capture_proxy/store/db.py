"""Engine, sessions and schema migrations for the transactional store.

SQLite (embedded default) runs in WAL mode with ``BEGIN IMMEDIATE`` transactions, so the
episode-wide counter is taken under the database write lock even across processes; PostgreSQL
takes it under the episode row's lock (``UPDATE … RETURNING``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from capture_proxy.store.urls import store_url

#: The alembic scripts ship inside the package (``capture_proxy/migrations``, a link to the
#: repository's top-level ``migrations/`` in a checkout), so an installed proxy can migrate.
MIGRATIONS_DIR = Path(__file__).parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30.0


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, echo: bool = False) -> AsyncEngine:
    """The store's engine; ``url`` in any form :func:`store_url` takes (the async driver is
    the store's own)."""
    url = store_url(url)
    if not is_sqlite(url):
        return create_async_engine(url, echo=echo, pool_pre_ping=True)
    engine = create_async_engine(url, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy emit BEGIN itself (below), and use WAL for concurrent readers.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", store_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run the alembic migrations up to ``revision`` (blocking).

    The migration environment runs its own event loop, so when called from a thread that already
    runs one, the migration runs in a worker thread (and this call blocks until it is done).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        command.upgrade(alembic_config(url), revision)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(command.upgrade, alembic_config(url), revision).result()


async def current_revision(url: str) -> str | None:
    """The store's schema revision (None for an empty store)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(
                lambda sync: MigrationContext.configure(sync).get_current_revision()
            )
    finally:
        await engine.dispose()


async def upgrade_async(url: str, revision: str = "head") -> None:
    await asyncio.to_thread(upgrade, url, revision)
