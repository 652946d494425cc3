"""uvicorn's HTTP protocol: a response's head and body in one write, and a request's lost
connection told to whoever waits on it (issue 11).

uvicorn writes a response's status line and headers when the application sends
``http.response.start``, and its body at ``http.response.body``: two ``send`` system calls, two
TCP segments, for every JSON answer, and the client wakes twice. :class:`MergedWritesProtocol`
gives uvicorn's protocol a transport (:class:`MergedWrites`) that holds a write until the next
one or until the event loop's current step ends, whichever comes first: what the application
sends in one go (a head, then its body) leaves in one write, and nothing waits longer than the
step that wrote it (a stream's head still goes out before its first chunk is awaited). Measured
at c=1 on the stub engine, paired (``benchmarks/bench_pair.py``): 0.97× the CPU per call,
0.95× streaming.

A lost connection: ASGI tells an application that its client left only through ``receive()``,
so an application that waits on something else (the engine) must keep a task in ``receive()`` to
hear of it — a task and two turns of the loop per request, ~2–3 % of a call's CPU. The protocol
here puts a :class:`LostConnection` into every request's scope (``scope["extensions"]
[LOST_CONNECTION]``) and calls it when the connection is lost before the response is complete;
:class:`~capture_proxy.responses.ClientWatch` subscribes to it when it is there, and listens on
``receive()`` under any other server.

``serve`` and the devkit's proxy thread run uvicorn with ``http=MergedWritesProtocol``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The scope extension that holds a request's :class:`LostConnection`.
LOST_CONNECTION = "capture_proxy.lost_connection"


class MergedWrites:
    """A transport whose writes wait for the next write or the end of the loop's step.

    Everything but ``write`` / ``writelines`` / ``close`` / ``write_eof`` / ``abort`` is the
    real transport's (flow control included: the held bytes are few and wait one step at most).
    """

    __slots__ = ("_flush", "_held", "_loop", "_real")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._loop = loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is None:  # held until the next write, or the end of this step
            self._held = bytes(data)
            self._flush = self._loop.call_soon(self._send_held)
            return
        held, self._held = self._held, None
        self._cancel_flush()
        self._real.write(held + bytes(data))

    def writelines(self, lines: Any) -> None:
        self.write(b"".join(lines))

    def _send_held(self) -> None:
        self._flush = None
        held, self._held = self._held, None
        if held and not self._real.is_closing():
            self._real.write(held)

    def _cancel_flush(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def close(self) -> None:
        self._cancel_flush()
        self._send_held()  # (a closing transport still sends what was written before)
        self._real.close()

    def write_eof(self) -> None:
        self._cancel_flush()
        self._send_held()
        self._real.write_eof()

    def abort(self) -> None:
        self._cancel_flush()
        self._held = None
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class LostConnection:
    """The callbacks to run if a request's connection is lost before its response is complete
    (each once, on the loop's thread, from the protocol's ``connection_lost``)."""

    __slots__ = ("callbacks", "lost")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], object]] = []
        self.lost = False

    def fire(self) -> None:
        self.lost = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class MergedWritesProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through :class:`MergedWrites`, with a
    :class:`LostConnection` in every request's scope."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        merged: Any = MergedWrites(transport, self.loop)
        super().connection_made(merged)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        scope: Any = self.scope
        scope["extensions"] = {LOST_CONNECTION: LostConnection()}

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # (set only before the response completed)
            extensions: Any = cycle.scope.get("extensions") or {}
            lost = extensions.get(LOST_CONNECTION)
            if isinstance(lost, LostConnection):
                lost.fire()
