"""SIGTERM and SIGHUP stop the dev kit's commands like Ctrl-C (capture_devkit/signals.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from capture_devkit.signals import STOPPING, stopped_like_ctrl_c


@pytest.fixture(autouse=True)
def _default_dispositions() -> Iterator[None]:
    saved = {number: signal.signal(number, signal.SIG_DFL) for number in STOPPING}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def _deliver(number: int) -> None:
    os.kill(os.getpid(), number)
    time.sleep(0.01)  # (the handler runs between bytecodes of this thread)


@pytest.mark.parametrize("number", STOPPING)
def test_the_signal_interrupts_the_block_then_the_default_returns(number: int) -> None:
    with pytest.raises(KeyboardInterrupt), stopped_like_ctrl_c():
        _deliver(number)
    assert signal.getsignal(number) is signal.SIG_DFL


def test_a_second_signal_lets_the_stop_finish() -> None:
    stopped = False
    with pytest.raises(KeyboardInterrupt), stopped_like_ctrl_c():
        try:
            _deliver(signal.SIGTERM)
        finally:
            _deliver(signal.SIGHUP)  # while stopping: ignored
            stopped = True
    assert stopped


def test_an_ignored_signal_stays_ignored() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    with stopped_like_ctrl_c():
        _deliver(signal.SIGHUP)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # (the other one is set)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
