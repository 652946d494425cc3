"""Token arrays are stored packed: little-endian int32 ids, float32 logprobs.

A token prefix is a byte prefix of the packed ids. ``ids_array``/``logprobs_array`` give the
bundle's read-only int64/float64 arrays (capture_contracts.bundle) without a list in between.

The ids the store keeps are the engine's (its ``prompt_token_ids`` and ``token_ids``): ids that
are not 32-bit integers are the engine's fault, an :class:`~capture_proxy.errors.UpstreamError`
(never a silent conversion: ``1.5`` or ``"7"`` are refused, not stored as 1 and 7).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from capture_proxy.errors import UpstreamError

_IDS = np.dtype("<i4")
_LOGPROBS = np.dtype("<f4")


def pack_ids(ids: Sequence[int] | None) -> bytes:
    """Little-endian int32 (``struct``: a third of numpy's time for a list of Python ints, and
    it refuses what is not an integer in range)."""
    if ids is None or len(ids) == 0:
        return b""
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise UpstreamError(f"the engine's token ids are not 32-bit integers: {exc}") from None


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
