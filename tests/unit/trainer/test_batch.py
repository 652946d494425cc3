"""Rows readers (JSON lines, Parquet) and the padded batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.rowkit import make_row, simple_rows
from trainer_bridge.batch import collate
from trainer_bridge.errors import TrainerError
from trainer_bridge.rows_io import read_rows, row_from_dict, write_jsonl, write_parquet

FORMATS_EXAMPLE = {
    "row_id": "ep-1/0",
    "episode_id": "ep-1",
    "group_id": "task-7",
    "reward": 1.0,
    "input_ids": [1, 2, 3, 4, 5],
    "loss_mask": [0, 0, 0, 1, 1],
    "behavior_logprobs": [0.0, 0.0, 0.0, -0.5, -1.25],
    "spans": [{"call_id": "c-0001", "start": 3, "end": 5, "owned": True}],
}


def test_jsonl_and_parquet_read_to_the_same_rows(tmp_path: Path) -> None:
    rows = simple_rows()
    write_jsonl(rows, tmp_path / "rows.jsonl")
    (tmp_path / "dir").mkdir()
    write_parquet(rows[:3], tmp_path / "dir" / "part-0.parquet")
    write_parquet(rows[3:], tmp_path / "dir" / "part-1.parquet")
    write_parquet(rows, tmp_path / "rows.parquet")
    from_jsonl = read_rows(tmp_path / "rows.jsonl")
    from_file = read_rows(tmp_path / "rows.parquet")
    from_dir = read_rows(tmp_path / "dir")
    # Parquet stores behaviour logprobs as float32: compare the batches, which are float32 too.
    assert [r.row_id for r in from_file] == [r.row_id for r in rows]
    assert [r.row_id for r in from_dir] == [r.row_id for r in rows]
    for other in (from_file, from_dir):
        a, b = collate(from_jsonl), collate(other)
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.behavior_logprobs, b.behavior_logprobs)
        assert a.episode_ids == b.episode_ids and a.group_ids == b.group_ids
        assert [r.spans for r in other] == [r.spans for r in rows]


def test_the_documented_example_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(FORMATS_EXAMPLE) + "\n\n")
    (row,) = read_rows(path)
    assert row.owned_tokens == 2
    assert row.to_dict() == FORMATS_EXAMPLE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": None}, "missing or null field"),
        ({"loss_mask": [0, 0, 1, 1]}, "must have one length"),
        ({"loss_mask": [0, 0, 0, 2, 1]}, "other than 0/1"),
        ({"loss_mask": [1, 0, 0, 1, 1]}, "first position cannot be owned"),
        ({"spans": [{"call_id": "c", "start": 3, "end": 9, "owned": True}]}, "outside the row"),
        ({"input_ids": ["x", 2, 3, 4, 5]}, "malformed field"),
    ],
)
def test_malformed_rows_are_trainer_errors(change: dict[str, object], message: str) -> None:
    with pytest.raises(TrainerError, match=message):
        row_from_dict({**FORMATS_EXAMPLE, **change})


def test_collate_sorts_pads_and_indexes() -> None:
    rows = [
        make_row("b/0", "b", "g2", 0.0, [5, 6, 7], [(1, 3)], logprob=-2.0),
        make_row("a/1", "a", "g1", 1.0, [1, 2, 3, 4, 5], [(3, 5)], logprob=-1.0),
        make_row("a/0", "a", "g1", 1.0, [1, 2], [(1, 2)], logprob=-3.0),
    ]
    batch = collate(rows, pad_id=0)
    assert batch.row_ids == ("a/0", "a/1", "b/0")
    assert batch.episode_ids == ("a", "b") and batch.group_ids == ("g1", "g2")
    assert batch.episode_index.tolist() == [0, 0, 1]
    assert batch.group_index.tolist() == [0, 0, 1]
    assert batch.input_ids.tolist() == [[1, 2, 0, 0, 0], [1, 2, 3, 4, 5], [5, 6, 7, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0, 0], [1] * 5, [1, 1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]
    assert batch.behavior_logprobs.tolist() == [
        [0, -3, 0, 0, 0],
        [0, 0, 0, -1, -1],
        [0, -2, -2, 0, 0],
    ]
    assert batch.owned_tokens == 5 and batch.num_rows == 3 and batch.num_episodes == 2
    assert batch.advantages is None
    # Input order does not matter.
    again = collate(list(reversed(rows)))
    assert torch.equal(again.input_ids, batch.input_ids) and again.row_ids == batch.row_ids


def test_micro_batches_trim_padding_and_keep_numbering() -> None:
    rows = [
        make_row("a/0", "a", "g", 1.0, [1, 2], [(1, 2)]),
        make_row("b/0", "b", "g", 0.0, [1, 2, 3], [(1, 3)]),
        make_row("c/0", "c", "h", 0.0, [1, 2, 3, 4, 5, 6], [(1, 6)]),
    ]
    parts = collate(rows).micro_batches(2)
    assert [p.row_ids for p in parts] == [("a/0", "b/0"), ("c/0",)]
    assert [p.input_ids.shape[1] for p in parts] == [3, 6]
    assert parts[1].episode_index.tolist() == [2] and parts[1].episode_ids == ("a", "b", "c")
    assert collate(rows).micro_batches(None)[0].num_rows == 3
    with pytest.raises(TrainerError):
        collate(rows).micro_batches(0)


def test_duplicate_row_ids_and_empty_input_are_rejected() -> None:
    row = make_row("a/0", "a", "g", 1.0, [1, 2], [(1, 2)])
    with pytest.raises(TrainerError, match="duplicate row_id"):
        collate([row, row])
    with pytest.raises(TrainerError, match="no rows"):
        collate([])
