"""``capture-proxy episodes list|show|close|export``: a running proxy's episodes, over its REST API.

::

    capture-proxy episodes list   [--status open|closing|closed] [--group G]
    capture-proxy episodes show   EPISODE
    capture-proxy episodes close  EPISODE --reward R [--wait S] [--cancel-outstanding]
                                  [--discard CALL]... [--accept CALL]...
    capture-proxy episodes export EPISODE... [--out DIR]

Every action takes ``--url`` (default: the ``public_url`` setting, else ``http://HOST:PORT`` from
the settings) and ``--json`` (one JSON document on stdout, for scripts); without it the answer is
a table. Exit codes: 0 done, 1 the proxy refused or cannot be reached (one line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from capture_proxy.settings import get_settings

TIMEOUT_S = 30.0


class CommandFailed(Exception):
    """One line for stderr: the proxy's error message, or why it cannot be reached."""


def default_url() -> str:
    settings = get_settings()
    return settings.public_url.rstrip("/") if settings.public_url else settings.local_url


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="the proxy's base URL (default from the settings)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser = argparse.ArgumentParser(prog="capture-proxy episodes", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", parents=[common], help="episodes, oldest first")
    listing.add_argument("--status", choices=["open", "closing", "closed"])
    listing.add_argument("--group", help="only this GRPO group")
    show = sub.add_parser("show", parents=[common], help="one episode and its calls")
    show.add_argument("episode")
    close = sub.add_parser("close", parents=[common], help="close an episode with its reward")
    close.add_argument("episode")
    close.add_argument("--reward", type=float, required=True)
    close.add_argument("--wait", type=float, default=0.0, help="seconds to wait for open calls")
    close.add_argument(
        "--cancel-outstanding", action="store_true", help="cancel calls still open after --wait"
    )
    close.add_argument("--discard", action="append", default=[], help="a call id to discard")
    close.add_argument("--accept", action="append", default=[], help="a call id to accept")
    export = sub.add_parser("export", parents=[common], help="write episode bundle files")
    export.add_argument("episodes", nargs="+")
    export.add_argument("--out", type=Path, default=Path("."), help="directory (default: .)")
    return parser


def _request(client: httpx.Client, method: str, path: str, **kw: Any) -> Any:
    try:
        response = client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise CommandFailed(f"cannot reach the proxy at {client.base_url}: {exc}") from exc
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise CommandFailed(f"{method} {path}: {response.status_code}: {message}")
    return response.json()


def _calls_cell(calls: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in calls.items() if v) or "none"


def _episodes_table(episodes: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{len(episodes)} episodes")
    table.add_column("episode", no_wrap=True)
    for name in ("group", "status", "reward", "calls", "exported"):
        table.add_column(name)
    for ep in episodes:
        reward = "—" if ep["reward"] is None else f"{ep['reward']:g}"
        table.add_row(
            ep["episode_id"],
            ep["group_id"],
            ep["status"],
            reward,
            _calls_cell(ep["calls"]),
            "yes" if ep["exported"] else "no",
        )
    return table


def _calls_table(calls: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{len(calls)} calls")
    table.add_column("call", no_wrap=True)
    for name in ("agent", "role", "status", "seq", "tokens", "finish", "error"):
        table.add_column(name)
    for call in calls:
        done = call["completed_seq"] if call["completed_seq"] is not None else "…"
        table.add_row(
            call["call_id"],
            call["agent_id"] or "—",
            call["role"],
            call["status"] + (f" ({call['mark']})" if call["mark"] else ""),
            f"{call['admitted_seq']}→{done}",
            f"{call['prompt_tokens']}+{call['completion_tokens']}",
            call["finish_reason"] or "",
            (call["error"] or "")[:60],
        )
    return table


def _export(client: httpx.Client, episodes: list[str], out: Path, quiet: bool) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with Progress(disable=quiet or len(episodes) < 2, transient=True) as progress:
        task = progress.add_task("exporting", total=len(episodes))
        for episode_id in episodes:
            bundle = _request(client, "GET", f"/episodes/{episode_id}/bundle")
            path = out / f"{episode_id}.json"
            path.write_text(json.dumps(bundle) + "\n", encoding="utf-8")
            written.append(str(path))
            progress.advance(task)
    return written


def run(args: argparse.Namespace, console: Console) -> Any:
    """Do the action; returns what ``--json`` prints."""
    with httpx.Client(base_url=args.url or default_url(), timeout=TIMEOUT_S) as client:
        if args.action == "list":
            params = {k: v for k, v in (("status", args.status), ("group_id", args.group)) if v}
            episodes = _request(client, "GET", "/episodes", params=params)
            if not args.json:
                console.print(_episodes_table(episodes))
            return episodes
        if args.action == "show":
            episode = _request(client, "GET", f"/episodes/{args.episode}")
            episode["call_list"] = _request(client, "GET", f"/episodes/{args.episode}/calls")
            if not args.json:
                console.print(_episodes_table([episode]))
                console.print(_calls_table(episode["call_list"]))
                console.print(f"viewer: {client.base_url}/episodes/{args.episode}/view")
            return episode
        if args.action == "close":
            body = {
                "reward": args.reward,
                "wait_s": args.wait,
                "cancel_outstanding": args.cancel_outstanding,
                "discarded_calls": args.discard,
                "accepted_calls": args.accept,
            }
            timeout = TIMEOUT_S + args.wait
            episode = _request(
                client, "POST", f"/episodes/{args.episode}/close", json=body, timeout=timeout
            )
            if not args.json:
                console.print(_episodes_table([episode]))
            return episode
        written = _export(client, args.episodes, args.out, quiet=args.json)
        if not args.json:
            for path in written:
                console.print(f"wrote {path}")
        return {"written": written}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        result = run(args, Console(width=None if sys.stdout.isatty() else 160))
    except CommandFailed as exc:
        print(f"capture-proxy episodes {args.action}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    return 0
