"""Reconstruction's errors (a bundle that is malformed is a format error, ``InvalidBundle``).

::

    CaptureError (capture_contracts.errors)
    └── ReconstructionError           an episode cannot be turned into rows
        └── EpisodeRefused            still open, unresolved calls, or accounting does not add up
"""

from __future__ import annotations

from capture_contracts.errors import CaptureError


class ReconstructionError(CaptureError):
    error_type = "reconstruction_error"


class EpisodeRefused(ReconstructionError):
    pass
