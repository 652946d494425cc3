"""``capture-proxy export --episode ID [--db URL] [--out FILE]``: write an episode bundle file."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from capture_contracts.errors import CaptureError
from capture_proxy.settings import get_settings
from capture_proxy.store.db import make_engine, make_sessionmaker
from capture_proxy.store.repository import Store
from capture_proxy.store.urls import store_url


async def load_bundle(db_url: str, episode_id: str) -> dict[str, Any]:
    engine = make_engine(db_url)
    try:
        return (await Store(make_sessionmaker(engine)).bundle(episode_id)).to_dict()
    finally:
        await engine.dispose()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy export", description=__doc__)
    parser.add_argument("--episode", required=True, help="episode id")
    parser.add_argument(
        "--db", help="store URL (default: CAPTURE_PROXY_STORE__URL or ./capture.db)"
    )
    parser.add_argument("--out", type=Path, help="bundle file (default: <episode>.json)")
    args = parser.parse_args(argv)
    db_url = store_url(args.db) if args.db else get_settings().store.url  # (refused: exit 2)
    try:
        bundle = asyncio.run(load_bundle(db_url, args.episode))
    except CaptureError as exc:
        print(f"capture-proxy export: {exc.message}", file=sys.stderr)
        return 1
    out: Path = args.out or Path(f"{args.episode}.json")
    out.write_text(json.dumps(bundle) + "\n", encoding="utf-8")
    print(f"wrote {out} ({len(bundle['calls'])} calls, status {bundle['status']})", file=sys.stderr)
    return 0
