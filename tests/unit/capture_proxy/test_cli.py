"""The ``capture-proxy`` entry point: lazy commands; a missing extra is one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic.script import ScriptDirectory

from capture_proxy.cli import COMMANDS, main
from capture_proxy.store.db import alembic_config


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["demo", "--help"], "openai"),
        (["train-step", "--rows", "r", "--model", "m", "--out", "o"], "torch"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(argv: list[str], missing: str) -> None:
    # A fresh interpreter in which ``missing`` cannot be imported (None in sys.modules).
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from capture_proxy.cli import main\n"
        f"raise SystemExit(main({argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    err = done.stderr.strip().splitlines()
    extra = COMMANDS[argv[0]].extra
    assert len(err) == 1 and f"needs {missing!r}" in err[0], done.stderr
    assert f"pip install 'capture-proxy[{extra}]'" in err[0]


HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def test_unknown_command_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_db_upgrade_creates_a_store(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/capture.db"
    assert main(["db", "upgrade", "--db", url]) == 0
    assert f"at revision {HEAD}" in capsys.readouterr().err
    assert main(["db", "upgrade", "--db", url]) == 0  # idempotent
    assert main(["db", "upgrade", "--db", url, "--revision", "nosuch"]) == 1  # alembic's refusal
    err = capsys.readouterr().err
    assert "capture-proxy db upgrade: CommandError: Can't locate revision" in err


def test_engine_refuses_a_directory_without_a_model(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a model directory (no config.json)" in err[0]


def test_engine_without_vllm_is_one_line() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import importlib.util; importlib.util.find_spec = lambda name, *a: None\n"
        "from capture_proxy.cli import main\n"
        "raise SystemExit(main(['engine', '--model', '.']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "needs vLLM in this Python" in done.stderr
