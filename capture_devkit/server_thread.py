"""The proxy app on uvicorn in a daemon thread, on a loopback port (the demo and the tests)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Self

import httpx
import uvicorn

from capture_proxy.app import create_app
from capture_proxy.http_protocol import MergedWritesProtocol
from capture_proxy.settings import Settings

STARTUP_TIMEOUT_S = 30.0


class ProxyThread:
    def __init__(
        self,
        settings: Settings,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        port: int | None = None,
    ) -> None:
        self.settings = settings
        self.port = settings.port if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(settings, upstream_transport=transport),
            host="127.0.0.1",
            port=self.port,
            http=MergedWritesProtocol,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=settings.keep_alive_s,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()))
        self._thread.daemon = True

    def start(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
