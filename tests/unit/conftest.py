"""Unit tests run in-process: no network sockets (``httpx.MockTransport``, ``ASGITransport``).

Connecting or binding an IP socket in a unit test fails it at once; real servers belong to
``tests/integration``. (Unix sockets, socket pairs and child processes stay allowed.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

_IP = {socket.AF_INET, socket.AF_INET6}


@pytest.fixture(autouse=True)
def no_network_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(original: Any) -> Any:
        def guarded(self: socket.socket, address: Any) -> Any:
            if self.family in _IP:
                raise AssertionError(f"a unit test opened a network socket to {address!r}")
            return original(self, address)

        return guarded

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, refuse(getattr(socket.socket, name)))
    yield
