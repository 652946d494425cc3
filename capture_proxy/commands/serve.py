"""``capture-proxy serve``: run the proxy with uvicorn.

Listening on anything but a loopback address needs an admin key (``--admin-key`` or
``CAPTURE_PROXY_AUTH__ADMIN_KEY``); without one ``serve`` prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import socket
import sys

from pydantic import SecretStr, ValidationError

from capture_proxy.api.auth import refusal_to_bind
from capture_proxy.settings import AuthSettings, load_settings
from capture_proxy.store.urls import store_url


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy serve", description=__doc__)
    parser.add_argument("--host", help="bind address (default from settings: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default from settings: 8100)")
    parser.add_argument("--upstream", help="vLLM base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--db", help="store URL, e.g. sqlite:///./capture.db")
    parser.add_argument(
        "--admin-key",
        help="admin key for the episode API; each episode then gets its own key "
        "(prefer CAPTURE_PROXY_AUTH__ADMIN_KEY: a flag is visible in the process list)",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per request (uvicorn's access log, on at info and below: ~10 %% of a "
        "call's CPU when calls come fast; every call is in the store and /metrics anyway)",
    )
    args = parser.parse_args(argv)

    settings = load_settings()  # a settings error is one line (InvalidSettings)
    if args.admin_key is not None:
        try:
            auth = AuthSettings(admin_key=SecretStr(args.admin_key))
        except ValidationError as exc:  # one line, never the key itself
            print(f"capture-proxy serve: --admin-key: {exc.errors()[0]['msg']}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"auth": auth})
    updates: dict[str, object] = {}
    if args.host:
        updates["host"] = args.host
    if args.port:
        updates["port"] = args.port
    if args.upstream:
        updates["upstream"] = settings.upstream.model_copy(update={"url": args.upstream})
    if args.db:
        updates["store"] = settings.store.model_copy(update={"url": store_url(args.db)})
    settings = settings.model_copy(update=updates)
    if settings.store.instance_name is None:  # one process per host and port: a restart's name
        name = f"{socket.gethostname()}:{settings.port}"
        store = settings.store.model_copy(update={"instance_name": name})
        settings = settings.model_copy(update={"store": store})
    refusal = refusal_to_bind(settings)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    if settings.continuation_template_dir is not None:  # (its faults in one line, before binding)
        from capture_proxy.chat_template import ChatTemplate

        ChatTemplate.load(settings.continuation_template_dir, settings.end_of_turn_token)

    import uvicorn

    from capture_proxy.app import create_app
    from capture_proxy.http_protocol import MergedWritesProtocol

    uvicorn.run(
        create_app(settings, freeze_startup_heap=True),
        host=settings.host,
        port=settings.port,
        http=MergedWritesProtocol,
        log_level=args.log_level,
        # Below info the access log is dropped anyway, after uvicorn has formatted its fields.
        access_log=not args.no_access_log and args.log_level.lower() in ("trace", "debug", "info"),
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=5,
    )
    return 0
