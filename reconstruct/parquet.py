"""The Parquet layout of training rows (docs/formats.md): one schema for writers and readers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

SPAN_TYPE = pa.struct(
    [
        ("call_id", pa.string()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("owned", pa.bool_()),
    ]
)

ROWS_SCHEMA = pa.schema(
    [
        ("row_id", pa.string()),
        ("episode_id", pa.string()),
        ("group_id", pa.string()),
        ("reward", pa.float64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("spans", pa.list_(SPAN_TYPE)),
    ]
)


def rows_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows given as their dicts (``Row.to_dict()``) → a table with :data:`ROWS_SCHEMA`."""
    return pa.Table.from_pylist(list(rows), schema=ROWS_SCHEMA)
