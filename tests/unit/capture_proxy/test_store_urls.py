"""The store URL an operator writes, in the form the store's engine needs (store/urls.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.cli import main
from capture_proxy.errors import InvalidSettings
from capture_proxy.settings import load_settings
from capture_proxy.store.urls import store_url


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("sqlite:///./capture.db", "sqlite+aiosqlite:///./capture.db"),
        ("sqlite:////abs/capture.db", "sqlite+aiosqlite:////abs/capture.db"),
        ("sqlite+pysqlite:///x.db?timeout=3", "sqlite+aiosqlite:///x.db?timeout=3"),
        ("postgresql://u:p%40ss@h:5432/db", "postgresql+asyncpg://u:p%40ss@h:5432/db"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql+psycopg2://h/db", "postgresql+asyncpg://h/db"),
        ("PostgreSQL://h/db", "postgresql+asyncpg://h/db"),
        # the store's own forms are kept exactly as written
        ("sqlite+aiosqlite:///:memory:", "sqlite+aiosqlite:///:memory:"),
        ("postgresql+asyncpg://h/db?ssl=require", "postgresql+asyncpg://h/db?ssl=require"),
    ],
)
def test_the_async_driver_is_added(given: str, used: str) -> None:
    assert store_url(given) == used


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("mysql://root:secret@h/db", "the store runs on SQLite or PostgreSQL, not 'mysql'"),
        ("./capture.db", "the store URL is not a database URL"),
        ("://h/db", "the store URL is not a database URL"),
        ("sql ite://x", "the store URL is not a database URL"),
    ],
)
def test_anything_else_is_one_line_without_the_url(given: str, says: str) -> None:
    with pytest.raises(InvalidSettings) as caught:
        store_url(given)
    message = caught.value.message
    assert message.startswith(says) and "\n" not in message
    assert "secret" not in message  # (a URL may hold a password: it is never shown)


def test_the_setting_takes_either_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_STORE__URL", "sqlite:///run/capture.db")
    assert load_settings().store.url == "sqlite+aiosqlite:///run/capture.db"
    monkeypatch.setenv("CAPTURE_PROXY_STORE__URL", "mysql://root:secret@h/db")
    with pytest.raises(InvalidSettings) as caught:
        load_settings()
    assert caught.value.message.startswith(
        "CAPTURE_PROXY_STORE__URL: the store runs on SQLite or PostgreSQL, not 'mysql'"
    )
    assert "secret" not in caught.value.message  # (the variable's value is not echoed either)


def test_commands_take_the_plain_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "plain.db"
    assert main(["db", "upgrade", "--db", f"sqlite:///{db}"]) == 0
    assert db.exists() and "at revision" in capsys.readouterr().err
    assert main(["export", "--db", f"sqlite:///{db}", "--episode", "nope"]) == 1
    assert "episode 'nope' not found" in capsys.readouterr().err  # the store answered


@pytest.mark.parametrize(
    "command",
    [["serve"], ["db", "upgrade"], ["export", "--episode", "e"], ["reconstruct", "--out", "x"]],
)
def test_every_command_refuses_another_database_in_one_line(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--db", "mysql://root:secret@h/db"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"capture-proxy {command[0]}: invalid setting: the store runs on SQLite or PostgreSQL, not "
        "'mysql' (e.g. sqlite:///./capture.db or postgresql://user@host:5432/db)"
    ]
