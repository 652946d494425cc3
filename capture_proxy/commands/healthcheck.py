"""``capture-proxy healthcheck [--url URL] [--ready]``: probe a proxy; exit 0 when it answers.

The container image's ``HEALTHCHECK`` (docker/Dockerfile): a slim image has no curl, and a probe
written as a command reads the same settings as the server (``host``, ``port``: it probes this
process, never the public URL, which may point at a load balancer). ``--ready`` probes
``/readyz`` (store and engine reachable) instead of ``/healthz`` (the process answers).
Exit codes: 0 healthy (or ready), 1 not, 2 usage.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from capture_proxy.settings import get_settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy healthcheck", description=__doc__)
    parser.add_argument("--url", help="the proxy's base URL (default from the settings)")
    parser.add_argument("--ready", action="store_true", help="probe /readyz instead of /healthz")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    base = args.url or get_settings().local_url  # this container's process, not the public URL
    url = base.rstrip("/") + ("/readyz" if args.ready else "/healthz")
    try:
        response = httpx.get(url, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"capture-proxy healthcheck: {url}: {exc!r}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(
            f"capture-proxy healthcheck: {url}: {response.status_code} {response.text[:300]}",
            file=sys.stderr,
        )
        return 1
    return 0
