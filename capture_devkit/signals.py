"""The dev kit's long-running commands (``engine``, ``demo``) stop on SIGTERM and SIGHUP the way
they stop on Ctrl-C.

Both start vLLM in a process group of its own (:mod:`capture_devkit.engine`), which a signal
sent to the command does not reach: only the command's own cleanup stops it. Python turns Ctrl-C
(SIGINT) into ``KeyboardInterrupt``, which runs that cleanup; SIGTERM (``kill``, ``timeout``, a
container's stop) and SIGHUP (the terminal closed) would end the command at once and leave the
engine running, holding its port and memory. Within :func:`stopped_like_ctrl_c` they raise
``KeyboardInterrupt`` too. A signal the command inherited ignored (``nohup``) stays ignored, and
a second one while the first stop runs is ignored, so that the stop finishes (SIGKILL still ends
the command at once).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: What ends a command like Ctrl-C within :func:`stopped_like_ctrl_c`.
STOPPING = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stopped_like_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``KeyboardInterrupt`` (once) while the block runs."""
    caught = False

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        nonlocal caught
        if caught:  # (already stopping: let that finish)
            return
        caught = True
        raise KeyboardInterrupt

    previous = {}
    for number in STOPPING:
        if signal.getsignal(number) is signal.SIG_DFL:
            previous[number] = signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
