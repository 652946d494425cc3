"""Token arrays are stored packed: little-endian int32 ids, float32 logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
