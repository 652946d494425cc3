"""Reconstruction: one closed episode's calls → a forest of contexts → training rows (DESIGN §5).

The core is pure (no I/O); :mod:`reconstruct.cli` reads and writes files.
"""

from reconstruct.core import reconstruct_episode
from reconstruct.records import (
    Accounting,
    CallRecord,
    EpisodeBundle,
    Reconstruction,
    Row,
    Span,
    parse_bundle,
)

__all__ = [
    "Accounting",
    "CallRecord",
    "EpisodeBundle",
    "Reconstruction",
    "Row",
    "Span",
    "parse_bundle",
    "reconstruct_episode",
]
