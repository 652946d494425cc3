"""``capture-proxy train-step`` end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture_proxy.cli import main as capture_proxy
from tests.support.rowkit import make_row, simple_rows
from trainer_bridge.rows_io import write_jsonl, write_parquet


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_train_step_json(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    rows = simple_rows(num_episodes=4, rows_per_episode=2)
    path = tmp_path / f"rows.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(rows, path)
    out = tmp_path / "out"
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir), "--out", str(out)]
    code = capture_proxy([*argv, "--json", "--lr", "1e-3", "--micro-batch-size", "3"])
    assert code == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows"] == 8 and stats["episodes"] == 4 and stats["micro_batches"] == 3
    assert stats["owned_tokens"] == sum(r.owned_tokens for r in rows)
    assert stats["grad_norm"] > 0 and stats["lr"] == 1e-3
    assert {"loss", "clip_fraction", "approx_kl", "mean_ratio"} <= stats.keys()
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


def test_train_step_table_and_normalize_std(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(simple_rows(), path)
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir)]
    assert capture_proxy([*argv, "--out", str(tmp_path / "o"), "--normalize-std"]) == 0
    text = capsys.readouterr().out
    assert "grad_norm" in text and "owned_tokens" in text


def test_inconsistent_rows_exit_1(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(
        [
            make_row("e/0", "e", "g", 1.0, [1, 2, 3], [(1, 3)]),
            make_row("e/1", "e", "g", 0.0, [1, 2, 3], [(1, 3)]),
        ],
        path,
    )
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir)]
    assert capture_proxy([*argv, "--out", str(tmp_path / "o")]) == 1
    assert "InconsistentRows" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert capture_proxy([*argv, "--out", str(tmp_path / "o"), "--micro-batch-size", "0"]) == 2


def test_groups_without_a_learning_signal_are_warned_about(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(
        [
            make_row("solo/0", "solo", "alone", 1.0, [1, 2, 3, 4], [(2, 4)]),
            make_row("a/0", "a", "tied", 0.5, [1, 2, 3], [(1, 3)]),
            make_row("b/0", "b", "tied", 0.5, [1, 2, 3], [(1, 3)]),
        ],
        path,
    )
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir), "--json"]
    assert capture_proxy([*argv, "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["loss"] == 0.0  # legal: the step runs, and learns nothing
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 3, captured.err
    assert "group 'alone' has one episode ('solo'): its GRPO advantage is 0" in warnings[0]
    assert "group 'tied': all 2 episodes have reward 0.5" in warnings[1]
    assert "the loss of this step is 0" in warnings[2]


def test_no_warning_when_groups_carry_signal(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(simple_rows(), path)  # two groups of two episodes, different rewards
    argv = ["train-step", "--rows", str(path), "--model", str(tiny_model_dir), "--json"]
    assert capture_proxy([*argv, "--out", str(tmp_path / "o")]) == 0
    assert "warning" not in capsys.readouterr().err
