"""Token arrays are stored packed: little-endian int32 ids, float32 logprobs.

A token prefix is a byte prefix of the packed ids. ``ids_array``/``logprobs_array`` give the
bundle's read-only int64/float64 arrays (capture_contracts.bundle) without a list in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_IDS = np.dtype("<i4")
_LOGPROBS = np.dtype("<f4")


def pack_ids(ids: Sequence[int] | None) -> bytes:
    return np.asarray(ids if ids is not None else [], dtype=_IDS).tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    return np.frombuffer(blob, dtype=_IDS).tolist()


def pack_logprobs(values: Sequence[float] | None) -> bytes:
    return np.asarray(values if values is not None else [], dtype=_LOGPROBS).tobytes()


def unpack_logprobs(blob: bytes | None) -> list[float]:
    if not blob:
        return []
    return np.frombuffer(blob, dtype=_LOGPROBS).astype(np.float64).tolist()


def _read_only(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


def ids_array(blob: bytes | None) -> npt.NDArray[np.int64]:
    return _read_only(np.frombuffer(blob or b"", dtype=_IDS).astype(np.int64))


def logprobs_array(blob: bytes | None) -> npt.NDArray[np.float64]:
    return _read_only(np.frombuffer(blob or b"", dtype=_LOGPROBS).astype(np.float64))
