"""``capture-proxy serve``: run the proxy with uvicorn."""

from __future__ import annotations

import argparse

from capture_proxy.settings import load_settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy serve", description=__doc__)
    parser.add_argument("--host", help="bind address (default from settings: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default from settings: 8100)")
    parser.add_argument("--upstream", help="vLLM base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--db", help="store URL, e.g. sqlite+aiosqlite:///./capture.db")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import uvicorn

    from capture_proxy.app import create_app

    settings = load_settings()
    updates: dict[str, object] = {}
    if args.host:
        updates["host"] = args.host
    if args.port:
        updates["port"] = args.port
    if args.upstream:
        updates["upstream"] = settings.upstream.model_copy(update={"url": args.upstream})
    if args.db:
        updates["store"] = settings.store.model_copy(update={"url": args.db})
    settings = settings.model_copy(update=updates)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
