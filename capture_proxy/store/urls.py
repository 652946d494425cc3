"""The store's URL in the form its engine needs: a supported database with its async driver.

The store runs SQLite on ``aiosqlite`` and PostgreSQL on ``asyncpg`` (its writer uses the
asyncpg connection itself). An operator writes the URL the database's own tools take —
``sqlite:///./capture.db``, ``postgresql://user@host/db`` — or names the driver; either way the
store gets the async form. Anything else is one clear :class:`InvalidSettings` line, before an
engine is built (SQLAlchemy's own refusal of a sync driver is a traceback from inside the app's
startup).
"""

from __future__ import annotations

from capture_proxy.errors import InvalidSettings

#: The async driver the store runs each supported database with.
ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}
#: Other names of a supported database (``postgres://`` is what many hosts hand out).
_ALIASES = {"postgres": "postgresql"}
EXAMPLES = "sqlite:///./capture.db or postgresql://user@host:5432/db"


def store_url(url: str) -> str:
    """``url`` with the store's async driver: ``sqlite:///x.db`` → ``sqlite+aiosqlite:///x.db``,
    ``postgres://…`` or ``postgresql+psycopg2://…`` → ``postgresql+asyncpg://…``; a URL already
    in that form is returned as it is. The rest of the URL is never rewritten (nor shown in an
    error: it may hold a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme or not scheme.replace("+", "").replace("_", "").isalnum():
        raise InvalidSettings(f"the store URL is not a database URL (e.g. {EXAMPLES})")
    name, _, driver = scheme.lower().partition("+")
    backend = _ALIASES.get(name, name)
    wanted = ASYNC_DRIVERS.get(backend)
    if wanted is None:
        raise InvalidSettings(
            f"the store runs on SQLite or PostgreSQL, not {name!r} (e.g. {EXAMPLES})"
        )
    if backend == name and driver == wanted:
        return url
    return f"{backend}+{wanted}://{rest}"
