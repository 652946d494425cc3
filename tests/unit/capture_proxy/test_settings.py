"""Settings from the environment: a mistake is one line naming the variable and what it expects."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture_proxy.cli import main
from capture_proxy.errors import InvalidSettings
from capture_proxy.settings import Settings, env_warnings, load_settings, setting_variables


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("CAPTURE_PROXY_"):
            monkeypatch.delenv(name)


def test_a_group_set_as_a_plain_value_names_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_UPSTREAM", "http://127.0.0.1:8000")
    with pytest.raises(InvalidSettings) as caught:
        load_settings()
    message = caught.value.message
    assert message.startswith("CAPTURE_PROXY_UPSTREAM='http://127.0.0.1:8000': this is a group")
    assert "CAPTURE_PROXY_UPSTREAM__URL" in message and "\n" not in message


def test_a_group_as_a_json_object_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_UPSTREAM", '{"url": "http://engine:8000"}')
    assert load_settings().upstream.url == "http://engine:8000"


@pytest.mark.parametrize(
    ("name", "value", "expects"),
    [
        ("CAPTURE_PROXY_PORT", "eighty", "expects a valid integer"),
        ("CAPTURE_PROXY_UPSTREAM__TIMEOUT_S", "soon", "expects a valid number"),
        ("CAPTURE_PROXY_CONTINUATION", "maybe", "expects 'stitch' or 'passthrough'"),
    ],
)
def test_a_wrong_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expects: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettings) as caught:
        load_settings()
    message = caught.value.message
    assert message.startswith(f"{name}={value!r}: {expects}") and "\n" not in message


def test_serve_reports_a_settings_error_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_UPSTREAM", "http://127.0.0.1:8000")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("capture-proxy serve: invalid setting: ")
    assert "CAPTURE_PROXY_UPSTREAM__URL" in err[0]


def test_serve_refuses_a_template_directory_it_cannot_use_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_CONTINUATION_TEMPLATE_DIR", str(tmp_path))
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"capture-proxy serve: invalid setting: cannot load the tokenizer in {tmp_path}:"
        f" [Errno 2] No such file or directory: '{tmp_path / 'tokenizer_config.json'}'"
    ]


def test_unknown_variables_are_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPTURE_PROXY_UPSTREAM_URL", "http://x")  # one underscore: a typo
    monkeypatch.setenv("CAPTURE_PROXY_STORE__URLS", "x")  # no such field in the group
    monkeypatch.setenv("CAPTURE_PROXY_UPSTREAM__OVERRIDES__TEMPERATURE", "1.0")  # a dict key
    monkeypatch.setenv("CAPTURE_PROXY_STORE__URL", "sqlite+aiosqlite:///x.db")
    warnings = env_warnings()
    assert len(warnings) == 3
    assert warnings.pop(0).startswith("CAPTURE_PROXY_STORE__URLS names no setting")
    # A dict key set on its own stays a string: legal, but not the number that was meant.
    assert load_settings().upstream.overrides == {"temperature": "1.0"}
    assert warnings[0].startswith("CAPTURE_PROXY_UPSTREAM_URL names no setting"), warnings
    assert warnings[1].startswith(
        "CAPTURE_PROXY_UPSTREAM__OVERRIDES__TEMPERATURE sets 'temperature' to the string '1.0'"
    )


def test_every_setting_has_one_variable() -> None:
    names = set(setting_variables())
    assert {
        "CAPTURE_PROXY_PORT",
        "CAPTURE_PROXY_UPSTREAM__URL",
        "CAPTURE_PROXY_STORE__URL",
    } <= names
    assert len(names) == len(Settings.model_fields) + sum(
        len(info.annotation.model_fields)  # type: ignore[union-attr]
        for info in Settings.model_fields.values()
        if hasattr(info.annotation, "model_fields")
    )
