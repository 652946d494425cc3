"""Training rows in and out: the typed ``Row`` record and readers for JSON lines and Parquet.

The columns are those of ``docs/formats.md`` ("Training row"): ``row_id``, ``episode_id``,
``group_id``, ``reward``, ``input_ids``, ``loss_mask``, ``behavior_logprobs``, ``spans``.
A JSON-lines file and a Parquet file (or a directory of ``*.parquet`` files) with the same columns
read to the same rows. Rows come back in file order (directories: files sorted by name); the batch
(``batch.collate``) fixes the training order itself, so readers need not.

No torch here: the readers are used by the CLI and by Ray Data workers before any model exists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_proxy.errors import TrainerError
from reconstruct.records import Span

ROW_COLUMNS: tuple[str, ...] = (
    "row_id",
    "episode_id",
    "group_id",
    "reward",
    "input_ids",
    "loss_mask",
    "behavior_logprobs",
    "spans",
)


@dataclass(frozen=True, slots=True)
class Row:
    """One training row (one kept context endpoint). Validated on construction."""

    row_id: str
    episode_id: str
    group_id: str
    reward: float
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    behavior_logprobs: tuple[float, ...]
    spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        where = f"row {self.row_id!r}"
        if n == 0:
            raise TrainerError(f"{where}: input_ids is empty", param="input_ids")
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise TrainerError(
                f"{where}: input_ids, loss_mask and behavior_logprobs must have one length, got "
                f"{n}, {len(self.loss_mask)} and {len(self.behavior_logprobs)}",
                param="loss_mask",
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrainerError(f"{where}: loss_mask holds values other than 0/1", param="loss_mask")
        if self.loss_mask[0] == 1:
            # Position 0 has no prefix: no logprob can be computed for it.
            raise TrainerError(f"{where}: the first position cannot be owned", param="loss_mask")
        if not math.isfinite(self.reward):
            raise TrainerError(f"{where}: reward is not finite", param="reward")
        for span in self.spans:
            if not 0 <= span.start <= span.end <= n:
                raise TrainerError(
                    f"{where}: span of call {span.call_id!r} [{span.start}, {span.end}) is "
                    f"outside the row (length {n})",
                    param="spans",
                )

    @property
    def owned_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines / Parquet record of this row (``docs/formats.md``)."""
        return {
            "row_id": self.row_id,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "input_ids": list(self.input_ids),
            "loss_mask": list(self.loss_mask),
            "behavior_logprobs": list(self.behavior_logprobs),
            "spans": [span.to_dict() for span in self.spans],
        }


def row_from_dict(record: Mapping[str, Any]) -> Row:
    """Build a ``Row`` from one decoded record; missing or null required fields are errors."""
    row_id = record.get("row_id")
    missing = [c for c in ROW_COLUMNS if c != "spans" and record.get(c) is None]
    if missing:
        raise TrainerError(
            f"row {row_id!r}: missing or null field(s) {', '.join(missing)} "
            "(an episode needs a reward before its rows can be trained)",
            param=missing[0],
        )
    try:
        spans = tuple(
            Span(
                call_id=str(s["call_id"]),
                start=int(s["start"]),
                end=int(s["end"]),
                owned=bool(s["owned"]),
            )
            for s in (record.get("spans") or ())
        )
        return Row(
            row_id=str(record["row_id"]),
            episode_id=str(record["episode_id"]),
            group_id=str(record["group_id"]),
            reward=float(record["reward"]),
            input_ids=tuple(int(t) for t in record["input_ids"]),
            loss_mask=tuple(int(m) for m in record["loss_mask"]),
            behavior_logprobs=tuple(float(x) for x in record["behavior_logprobs"]),
            spans=spans,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TrainerError(f"row {row_id!r}: malformed field ({exc})") from exc


def _read_jsonl(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainerError(f"{path}:{lineno}: not a JSON object ({exc})") from exc
            if not isinstance(record, dict):
                raise TrainerError(f"{path}:{lineno}: not a JSON object")
            yield row_from_dict(record)


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        if not files:
            raise TrainerError(f"{path}: directory holds no *.parquet files")
        return files
    return [path]


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    for file in _parquet_files(path):
        table = pq.read_table(file)
        absent = [c for c in ROW_COLUMNS if c != "spans" and c not in table.column_names]
        if absent:
            raise TrainerError(f"{file}: missing column(s) {', '.join(absent)}")
        yield from rows_from_records(table.to_pylist())


def rows_from_records(records: Iterable[Mapping[str, Any]]) -> Iterator[Row]:
    """Rows from decoded records (e.g. a Parquet table's ``to_pylist()`` or a Ray Data batch)."""
    for record in records:
        yield row_from_dict(record)


def read_rows(path: str | Path) -> list[Row]:
    """Read rows from a JSON-lines file, a Parquet file or a directory of Parquet files."""
    path = Path(path)
    if not path.exists():
        raise TrainerError(f"{path}: no such file or directory", param="rows")
    if path.is_dir() or path.suffix == ".parquet":
        rows = list(_read_parquet(path))
    else:
        rows = list(_read_jsonl(path))
    if not rows:
        raise TrainerError(f"{path}: no rows", param="rows")
    return rows


def write_jsonl(rows: Sequence[Row], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row.to_dict()) + "\n")


def write_parquet(rows: Sequence[Row], path: str | Path) -> None:
    """Write rows as one Parquet file with the documented columns (used by tests and tools)."""
    import pyarrow.parquet as pq

    from reconstruct.parquet import rows_table

    pq.write_table(rows_table([row.to_dict() for row in rows]), str(path))
