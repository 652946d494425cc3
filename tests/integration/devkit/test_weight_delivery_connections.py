"""Weight delivery never sends a request on a connection the engine may be closing.

vLLM runs on uvicorn, which closes a keep-alive connection idle for 5 s. The training loop
delivers weights once per iteration, ~5 s apart on this machine, and httpx keeps idle connections
for 5 s by default: a delivery's first request could go out on a connection uvicorn was closing
at that moment, and the loop died with "Server disconnected without sending a response" (seen
once in CI, iteration 14 of the closed-loop test). The engine here is a raw socket server that
does what uvicorn does at that edge: a request arriving on a connection idle for ~5 s is lost
(with httpx's default expiry this test fails with that same error).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture_devkit.train.weights import ReloadFromDisk

#: uvicorn closes at 5 s; a request arriving just before can still meet the close.
CLOSING_AFTER_S = 4.8
IDLE_S = 4.9


class _Engine:
    """Answers 200 to every request, except one on a connection idle CLOSING_AFTER_S or more,
    which it closes without an answer."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.connections = 0
        self.dropped = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        idle_since = time.monotonic()
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):  # the client closed it
                writer.close()
                return
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if time.monotonic() - idle_since >= CLOSING_AFTER_S:
                self.dropped += 1
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            idle_since = time.monotonic()

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(close(), self.loop)
        self.thread.join(10)


@pytest.fixture
def engine() -> Iterator[_Engine]:
    server = _Engine()
    yield server
    server.stop()


def test_a_delivery_after_an_idle_iteration_opens_a_new_connection(
    engine: _Engine, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{engine.port}"
    delivery = ReloadFromDisk(url, url, tmp_path)
    try:
        delivery._engine("/reset_prefix_cache")  # one iteration's delivery
        delivery._engine("/update_weight_version", {"new_version": "1"})  # (same connection)
        time.sleep(IDLE_S)  # the rollouts of the next iteration
        delivery._engine("/reset_prefix_cache")  # the next delivery
    finally:
        delivery.close()
    assert engine.dropped == 0 and engine.connections == 2
