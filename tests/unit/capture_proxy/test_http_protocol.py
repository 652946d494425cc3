"""The transport of capture_proxy/http_protocol.py: the writes of one step of the loop leave
as one, nothing is held past the step (a recording transport on a real event loop; uvicorn's
protocol on a real socket: tests/integration/capture_proxy/test_http_protocol_socket.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from capture_proxy.http_protocol import MergedWrites


class Recording:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def write_eof(self) -> None:
        self.writes.append(b"<eof>")

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


async def test_writes_of_one_step_leave_as_one() -> None:
    real = Recording()
    merged = MergedWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    merged.write(b"head ")
    merged.write(b"body")
    assert real.writes == [b"head body"]  # the second write sends both at once
    merged.write(b"lone")
    assert real.writes == [b"head body"]  # held until the step ends
    await asyncio.sleep(0)
    assert real.writes == [b"head body", b"lone"]
    await asyncio.sleep(0)
    assert real.writes == [b"head body", b"lone"]  # sent once, not again
    assert merged.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_close_and_eof_send_what_is_held_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = Recording()
    merged = MergedWrites(real, loop)  # type: ignore[arg-type]
    merged.writelines([b"a", b"b"])
    merged.write_eof()
    assert real.writes == [b"ab", b"<eof>"]
    merged.write(b"last")
    merged.close()
    assert (real.writes[-1], real.closed) == (b"last", True)
    await asyncio.sleep(0)
    assert real.writes.count(b"last") == 1
    dropped = Recording()
    merged = MergedWrites(dropped, loop)  # type: ignore[arg-type]
    merged.write(b"never")
    merged.abort()
    await asyncio.sleep(0)
    assert (dropped.writes, dropped.aborted) == ([], True)


async def test_a_write_held_while_the_connection_closes_is_not_sent() -> None:
    real = Recording()
    merged = MergedWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    merged.write(b"late")
    real.closed = True  # the peer went away before the step ended
    await asyncio.sleep(0)
    assert real.writes == []
