"""Reconstruction: one closed episode's calls → a forest of contexts → training rows (DESIGN §5).

The core is pure (no I/O, no service import); :mod:`reconstruct.cli` reads and writes files, and
the job that reads closed episodes from the store is the service's
(``capture_proxy.commands.reconstruct``). Its input and output formats are shared contracts,
re-exported here for convenience: the bundle (:mod:`capture_contracts.bundle`) and the row
(:mod:`capture_contracts.rows`).
"""

from capture_contracts.bundle import CallRecord, EpisodeBundle, parse_bundle
from capture_contracts.rows import Row, Span
from reconstruct.core import reconstruct_episode
from reconstruct.records import Accounting, Reconstruction

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
