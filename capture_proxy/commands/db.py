"""``capture-proxy db upgrade [--db URL] [--revision REV]``: run the store's migrations.

The migrations ship inside the package, so an installed proxy can create its own store from any
directory. ``--db`` defaults to the ``store.url`` setting (``CAPTURE_PROXY_STORE__URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from sqlalchemy import make_url

from capture_proxy.settings import get_settings
from capture_proxy.store.db import current_revision, upgrade
from capture_proxy.store.urls import store_url


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy db", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("upgrade", help="migrate the store's schema to the latest revision")
    up.add_argument("--db", help="store URL (default: CAPTURE_PROXY_STORE__URL or ./capture.db)")
    up.add_argument("--revision", default="head", help="target revision (default: head)")
    args = parser.parse_args(argv)
    url = store_url(args.db) if args.db else get_settings().store.url  # (refused: exit 2)
    try:
        upgrade(url, args.revision)
    except Exception as exc:  # alembic and the drivers raise many kinds; report one line
        first = next(iter(str(exc).splitlines()), "")  # (SQLAlchemy adds a line or more)
        print(f"capture-proxy db upgrade: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    shown = make_url(url).render_as_string(hide_password=True)
    print(f"store {shown} at revision {asyncio.run(current_revision(url))}", file=sys.stderr)
    return 0
