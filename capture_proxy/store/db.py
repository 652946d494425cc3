"""Engine, sessions and schema migrations for the transactional store.

SQLite (embedded default) runs in WAL mode with ``BEGIN IMMEDIATE`` transactions, so the
episode-wide counter is taken under the database write lock even across processes; PostgreSQL
takes it under the episode row's lock (``UPDATE … RETURNING``).
"""

from __future__ import annotations

import asyncio
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

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30.0


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, echo: bool = False) -> AsyncEngine:
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
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run the alembic migrations up to ``revision`` (blocking; call from sync code)."""
    command.upgrade(alembic_config(url), revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    await asyncio.to_thread(upgrade, url, revision)
