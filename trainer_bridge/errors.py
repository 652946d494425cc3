"""The trainer's errors.

::

    CaptureError (capture_contracts.errors)
    └── TrainerError                  rows cannot be trained (bad rows, settings, no signal)
        └── InconsistentRows          rows of one episode disagree on reward or group
"""

from __future__ import annotations

from capture_contracts.errors import CaptureError


class TrainerError(CaptureError):
    error_type = "trainer_error"


class InconsistentRows(TrainerError):
    pass
