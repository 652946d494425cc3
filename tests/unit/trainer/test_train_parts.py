"""The loop's pure parts (capture_devkit/train): settings, rewards, the curve, the run state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture_devkit.train.config import ConfigError, TrainConfig, from_args, from_mapping
from capture_devkit.train.loop import RunState
from capture_devkit.train.report import plot_curves, summary
from capture_devkit.train.reward import digit_share, uppercase_share

pytestmark = pytest.mark.unit


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"iterations": 7, "lr": 0.01, "training": "parent_only"}))
    config = from_args(["--config", str(path), "--iterations", "3", "--out", str(tmp_path)])
    assert (config.iterations, config.lr, config.training, config.out) == (
        3,
        0.01,
        "parent_only",
        tmp_path,
    )
    assert config.group_size == TrainConfig().group_size


@pytest.mark.parametrize(
    "values",
    [{"group_size": 1}, {"iterations": 0}, {"training": "both"}, {"nope": 1}, {"reward": "x"}],
)
def test_bad_settings_are_one_message(values: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        from_mapping(values)


def test_rewards() -> None:
    assert digit_share(["a1 b2", "33"]) == pytest.approx(4 / 6)  # spaces do not count
    assert uppercase_share(["Ab C", "1 d"]) == pytest.approx(2 / 4)  # letters only
    assert digit_share([""]) == uppercase_share(["12 !"]) == 0.0


def test_summary_compares_first_and_last_five() -> None:
    records = [{"reward_mean": float(i)} for i in range(10)]
    assert summary(records) == {"first_mean": 2.0, "last_mean": 7.0, "iterations": 10.0}


def test_reward_curve_is_a_png(tmp_path: Path) -> None:
    path = plot_curves(tmp_path / "c.png", {"a": [0.1, 0.2, 0.4], "b": [0.1, 0.1]})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_state_round_trip(tmp_path: Path) -> None:
    assert RunState.load(tmp_path) == RunState()
    state = RunState(iterations_done=3, version=3, weights="/w/v00003", runs=2)
    state.save(tmp_path)
    assert RunState.load(tmp_path) == state
