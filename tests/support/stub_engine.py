"""The fake engine (tests/fixtures/fake_engine.py) as a real HTTP server in its own process.

For fault tests that need an engine to kill, restart or slow down for real::

    python -m tests.support.stub_engine --port 8123

Same answers as the in-process fake (vLLM 0.32's fields; behaviour chosen by the model name), over
a real socket: a ``fake-broken`` stream ends with the connection cut mid-response, as a dying
engine's does.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import uvicorn

from tests.fixtures import fake_engine

_HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection"}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = httpx.Request(scope["method"], f"http://engine{scope['path']}", content=body)
    response = await fake_engine.handler(request)
    streamed = response.headers.get("content-type") == "text/event-stream"
    headers = [
        (k.lower().encode(), v.encode())
        for k, v in response.headers.items()
        if not streamed or k.lower().encode() not in _HOP_BY_HOP
    ]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    if streamed:
        async for chunk in response.aiter_raw():  # a ReadError cuts the connection (uvicorn)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    else:
        await send({"type": "http.response.body", "body": response.content, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
