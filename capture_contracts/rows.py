"""The training row (docs/formats.md "Training row"): one ``Row`` record and its file columns.

A row is one kept context endpoint of an episode (DESIGN §5.5). Reconstruction builds rows, the
job writes them to Parquet, the trainer reads them back (JSON lines or Parquet, same columns).
Arrays are read-only numpy arrays (int64 ids and mask, float64 logprobs); a row built from
sequences is converted on construction and validated: one length for the three arrays, a 0/1
mask that does not own position 0 (it has no prefix to be predicted from), spans inside the row
and a finite reward. Rows compare by identity (``eq=False``); use ``to_dict`` to compare contents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from capture_contracts.errors import InvalidRow

if TYPE_CHECKING:
    import pyarrow as pa

#: The columns of a row file, in order.
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
class Span:
    """One generation inside a row: ``input_ids[start:end]`` is the call's completion.

    ``weight_version`` is the policy version that sampled it (the call's); ``constrained`` says
    that all its tokens were decoded under a grammar's mask (``CallRecord.constrained``): their
    behaviour logprobs are of the masked distribution, so a learner keeps them out of the ratio.
    """

    call_id: str
    start: int
    end: int
    owned: bool
    weight_version: int | None = None
    constrained: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "call_id": self.call_id,
            "start": self.start,
            "end": self.end,
            "owned": self.owned,
        }
        if self.weight_version is not None:  # absent keys read back as the defaults
            out["weight_version"] = self.weight_version
        if self.constrained:
            out["constrained"] = True
        return out


def _frozen(values: Any, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A read-only 1-D array; a read-only array of the right type is taken as it is (no copy)."""
    array = np.asarray(values, dtype=dtype).reshape(-1)
    if array.flags.writeable:
        array = array.copy()
        array.flags.writeable = False
    return array


@dataclass(frozen=True, slots=True, eq=False)
class Row:
    """One training row: one kept context endpoint (DESIGN §5.5). Validated on construction."""

    row_id: str
    episode_id: str
    group_id: str
    reward: float | None
    input_ids: npt.NDArray[np.int64]  # [T]
    loss_mask: npt.NDArray[np.int64]  # [T], 1 exactly on owned positions
    behavior_logprobs: npt.NDArray[np.float64]  # [T], captured logprob where owned, 0.0 elsewhere
    spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        where = f"row {self.row_id!r}"
        try:
            ids = _frozen(self.input_ids, np.int64)
            mask = np.array(self.loss_mask).reshape(-1)
            logprobs = _frozen(self.behavior_logprobs, np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRow(f"{where}: malformed field ({exc})") from exc
        n = len(ids)
        if n == 0:
            raise InvalidRow(f"{where}: input_ids is empty", param="input_ids")
        if len(mask) != n or len(logprobs) != n:
            raise InvalidRow(
                f"{where}: input_ids, loss_mask and behavior_logprobs must have one length, got "
                f"{n}, {len(mask)} and {len(logprobs)}",
                param="loss_mask",
            )
        if mask.size and not np.isin(mask, (0, 1)).all():
            raise InvalidRow(f"{where}: loss_mask holds values other than 0/1", param="loss_mask")
        if mask[0] == 1:
            raise InvalidRow(f"{where}: the first position cannot be owned", param="loss_mask")
        if self.reward is not None and not math.isfinite(self.reward):
            raise InvalidRow(f"{where}: reward is not finite", param="reward")
        for span in self.spans:
            if not 0 <= span.start <= span.end <= n:
                raise InvalidRow(
                    f"{where}: span of call {span.call_id!r} [{span.start}, {span.end}) is "
                    f"outside the row (length {n})",
                    param="spans",
                )
        object.__setattr__(self, "input_ids", ids)
        object.__setattr__(self, "loss_mask", _frozen(mask, np.int64))
        object.__setattr__(self, "behavior_logprobs", logprobs)
        object.__setattr__(self, "spans", tuple(self.spans))

    @property
    def owned_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def position_masks(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``[T]`` 0/1 constrained positions and ``[T]`` weight versions (-1: unknown/none)."""
        n = len(self.input_ids)
        constrained = np.zeros(n, dtype=np.int64)
        versions = np.full(n, -1, dtype=np.int64)
        for span in self.spans:
            if span.constrained:
                constrained[span.start : span.end] = 1
            if span.weight_version is not None:
                versions[span.start : span.end] = span.weight_version
        return constrained, versions

    @property
    def endpoint_call_id(self) -> str:
        """The call whose prompt + completion this row is (its deepest span)."""
        return self.spans[-1].call_id

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines / Parquet record of this row (``docs/formats.md``)."""
        return {
            "row_id": self.row_id,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "behavior_logprobs": self.behavior_logprobs.tolist(),
            "spans": [span.to_dict() for span in self.spans],
        }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def parse_row(record: Mapping[str, Any]) -> Row:
    """One decoded row record → :class:`Row`; missing or null required fields are errors."""
    row_id = record.get("row_id")
    missing = [c for c in ROW_COLUMNS if c != "spans" and record.get(c) is None]
    if missing:
        raise InvalidRow(
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
                weight_version=_optional_int(s.get("weight_version")),
                constrained=bool(s.get("constrained") or False),
            )
            for s in (record.get("spans") or ())
        )
        return Row(
            row_id=str(record["row_id"]),
            episode_id=str(record["episode_id"]),
            group_id=str(record["group_id"]),
            reward=float(record["reward"]),
            input_ids=np.array([int(t) for t in record["input_ids"]], dtype=np.int64),
            loss_mask=np.array([int(m) for m in record["loss_mask"]]),
            behavior_logprobs=np.array(
                [float(x) for x in record["behavior_logprobs"]], dtype=np.float64
            ),
            spans=spans,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRow(f"row {row_id!r}: malformed field ({exc})") from exc


def rows_schema() -> pa.Schema:
    """The Parquet schema of a row file (pyarrow is imported only here)."""
    import pyarrow as pa

    span = pa.struct(
        [
            ("call_id", pa.string()),
            ("start", pa.int32()),
            ("end", pa.int32()),
            ("owned", pa.bool_()),
            ("weight_version", pa.int64()),
            ("constrained", pa.bool_()),
        ]
    )
    return pa.schema(
        [
            ("row_id", pa.string()),
            ("episode_id", pa.string()),
            ("group_id", pa.string()),
            ("reward", pa.float64()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("behavior_logprobs", pa.list_(pa.float32())),
            ("spans", pa.list_(span)),
        ]
    )


def rows_table(rows: Sequence[Row]) -> pa.Table:
    """Rows → a Parquet-ready table with :func:`rows_schema`."""
    import pyarrow as pa

    return pa.Table.from_pylist([row.to_dict() for row in rows], schema=rows_schema())
