"""``capture-proxy reconstruct --bundle``: rows as JSON lines, report, clear failures."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from capture_contracts.bundle import SCHEMA
from capture_contracts.rows import ROW_COLUMNS
from capture_proxy.cli import main as capture_proxy_main
from capture_proxy.commands.reconstruct import main as reconstruct_command
from reconstruct.cli import main
from tests.golden.make_golden import SCENARIOS
from tests.support.builders import EpisodeBuilder


@pytest.fixture
def bundle_file(tmp_path: Path) -> Path:
    path = tmp_path / "bundle.json"
    path.write_text(json.dumps(SCENARIOS["parent_workers_resume"]()), encoding="utf-8")
    return path


def test_rows_to_stdout(bundle_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--bundle", str(bundle_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in out]
    assert [r["row_id"] for r in rows] == ["ep-workers/0", "ep-workers/1", "ep-workers/2"]
    assert tuple(rows[0]) == ROW_COLUMNS


def test_out_and_report_files(bundle_file: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "rows.jsonl", tmp_path / "report.json"
    argv = ["--bundle", str(bundle_file), "--out", str(out), "--report", str(report)]
    assert capture_proxy_main(["reconstruct", *argv]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    accounting = json.loads(report.read_text(encoding="utf-8"))
    assert accounting["counts"]["trained"] == 6 and accounting["rows"] == 3


def test_trainable_roles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps(SCENARIOS["chain20_compaction"]()), encoding="utf-8")
    assert main(["--bundle", str(path), "--trainable-roles", "policy"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sum(sum(r["loss_mask"]) for r in rows) == 57


def test_invalid_bundle_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema": SCHEMA, "episode_id": "e"}), encoding="utf-8")
    out = tmp_path / "rows.jsonl"
    assert main(["--bundle", str(path), "--out", str(out)]) == 1
    assert "InvalidBundle" in capsys.readouterr().err
    assert not out.exists()
    path.write_text("{not json", encoding="utf-8")
    assert main(["--bundle", str(path)]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["--bundle", str(tmp_path / "missing.json")]) == 1
    assert "cannot read bundle" in capsys.readouterr().err


def test_refused_episode_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = EpisodeBuilder()
    b.admit("hanging", [1])
    path = tmp_path / "b.json"
    path.write_text(json.dumps(b.bundle()), encoding="utf-8")
    assert main(["--bundle", str(path)]) == 1
    err = capsys.readouterr().err
    assert "EpisodeRefused" in err and "unresolved" in err


def test_bundle_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "--bundle" in capsys.readouterr().err


def test_db_mode_is_delegated_to_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def job_main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    job = types.ModuleType("capture_proxy.reconstruct_job")
    job.main = job_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "capture_proxy.reconstruct_job", job)
    argv = ["--db", "sqlite:///x.db", "--out", "dir"]
    assert reconstruct_command(argv) == 7
    assert seen == [argv]
