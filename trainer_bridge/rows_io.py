"""Training rows in and out: readers and writers for JSON lines and Parquet.

The row record and its columns are the shared format (:mod:`capture_contracts.rows`,
``docs/formats.md`` "Training row"); a malformed row read here is a :class:`TrainerError`.
A JSON-lines file and a Parquet file (or a directory of ``*.parquet`` files) with the same columns
read to the same rows. Rows come back in file order (directories: files sorted by name); the batch
(``batch.collate``) fixes the training order itself, so readers need not.

No torch here: the readers are used by the CLI and by Ray Data workers before any model exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from capture_contracts.errors import InvalidRow
from capture_contracts.rows import ROW_COLUMNS, Row, parse_row, rows_table
from trainer_bridge.errors import TrainerError


def row_from_dict(record: Mapping[str, Any]) -> Row:
    """Build a ``Row`` from one decoded record; a malformed one is a :class:`TrainerError`."""
    try:
        return parse_row(record)
    except InvalidRow as exc:
        raise TrainerError(exc.message, param=exc.param) from exc


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

    pq.write_table(rows_table(rows), str(path))
