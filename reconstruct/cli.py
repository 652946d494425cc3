"""``capture-proxy reconstruct``: a bundle file → rows (JSON lines) + accounting report.

::

    capture-proxy reconstruct --bundle FILE [--out ROWS.jsonl] [--report REPORT.json]
                              [--trainable-roles policy,compaction]
    capture-proxy reconstruct --db URL --out DIR [--follow]   (capture_proxy.reconstruct_job)

Rows go to stdout when no ``--out`` is given. A malformed bundle or a refused episode exits with
status 1 and a one-line message on stderr; nothing is written for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from capture_contracts.errors import CaptureError
from capture_contracts.vocabulary import DEFAULT_TRAINABLE_ROLES
from reconstruct.core import reconstruct_episode
from reconstruct.errors import ReconstructionError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capture-proxy reconstruct",
        description="Turn an episode bundle into training rows (JSON lines) and an accounting "
        "report; with --db, run the reconstruction job over the store.",
    )
    parser.add_argument("--bundle", type=Path, help="episode bundle file (capture-episode/v1)")
    parser.add_argument("--out", help="rows file (JSON lines); stdout when omitted")
    parser.add_argument("--report", type=Path, help="accounting report file (JSON)")
    parser.add_argument(
        "--trainable-roles",
        default=",".join(sorted(DEFAULT_TRAINABLE_ROLES)),
        help="comma-separated roles that own loss (default: %(default)s)",
    )
    return parser


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReconstructionError(f"cannot read bundle {path}: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReconstructionError(f"bundle {path} is not valid JSON: {exc}") from exc


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.bundle is None:
        parser.error("--bundle FILE (or --db URL) is required")
    roles = [r.strip() for r in args.trainable_roles.split(",") if r.strip()]
    try:
        result_ = reconstruct_episode(_load(args.bundle), trainable_roles=roles)
    except CaptureError as exc:
        kind = type(exc).__name__
        print(f"capture-proxy reconstruct: {kind}: {exc.message}", file=sys.stderr)
        return 1
    lines = "".join(json.dumps(row.to_dict(), separators=(",", ":")) + "\n" for row in result_.rows)
    if args.out is None or args.out == "-":
        sys.stdout.write(lines)
    else:
        Path(args.out).write_text(lines, encoding="utf-8")
    if args.report is not None:
        args.report.write_text(
            json.dumps(result_.accounting.to_dict(), indent=2) + "\n", encoding="utf-8"
        )
    acc = result_.accounting
    print(
        f"episode {acc.episode_id}: {acc.rows} rows, {acc.owned_tokens} owned of "
        f"{acc.row_tokens} tokens; {acc.counts}",
        file=sys.stderr,
    )
    return 0
