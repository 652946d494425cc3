"""A PostgreSQL store URL in the plain form, with a password (store/urls.py, commands/db.py)."""

from __future__ import annotations

import pytest

from capture_proxy.cli import main


def test_db_upgrade_does_not_show_the_password(
    postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the test server trusts local connections: a password in the URL is carried, never asked for
    plain = postgres_url.replace("postgresql+asyncpg://postgres@", "postgresql://postgres:s3cret@")
    assert main(["db", "upgrade", "--db", plain]) == 0
    err = capsys.readouterr().err
    assert "at revision" in err and "postgres:***@" in err and "s3cret" not in err
