"""The reconstruction job (the service's: it reads the store): closed episodes → Parquet rows.

::

    capture-proxy reconstruct --db URL --out DIR [--follow] [--interval S] [--batch N]

Per batch: reconstruct every episode (refused ones are skipped and reported, never partially
emitted), write ``rows-<id>.parquet`` and ``report-<id>.json`` (temporary name, fsync, rename),
then record the file and mark its episodes exported in ONE transaction. A crash after writing
and before marking leaves a file no export row names: the next run moves such orphans to
``DIR/orphans/`` before exporting those episodes again, so the rows in ``DIR`` never repeat an
episode and no marked episode lacks its file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.progress import Progress

from capture_contracts.errors import FormatError
from capture_contracts.rows import rows_table
from capture_contracts.vocabulary import DEFAULT_TRAINABLE_ROLES
from capture_proxy.store.db import make_engine, make_sessionmaker
from capture_proxy.store.repository import Store
from reconstruct import Reconstruction, reconstruct_episode
from reconstruct.errors import ReconstructionError


@dataclass
class JobReport:
    exported_episodes: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    rows: int = 0


def _write_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


async def quarantine_orphans(store: Store, out_dir: Path) -> list[str]:
    """Move row files no export records (a crash between write and mark) to orphans/."""
    recorded = {Path(p).name for p in await store.exports.export_paths()}
    moved = []
    for path in sorted(out_dir.glob("rows-*.parquet")):
        if path.name in recorded:
            continue
        orphans = out_dir / "orphans"
        orphans.mkdir(exist_ok=True)
        os.replace(path, orphans / path.name)
        report = path.with_name(path.name.replace("rows-", "report-").replace(".parquet", ".json"))
        if report.exists():
            os.replace(report, orphans / report.name)
        moved.append(path.name)
    for tmp in out_dir.glob(".*.tmp"):
        tmp.unlink()
    return moved


async def export_batch(
    store: Store,
    out_dir: Path,
    episode_ids: Sequence[str],
    trainable_roles: frozenset[str],
    report: JobReport,
    progress: Progress | None = None,
) -> None:
    done: list[tuple[str, Reconstruction]] = []
    task = progress.add_task("reconstructing", total=len(episode_ids)) if progress else None
    for episode_id in episode_ids:
        bundle = await store.bundle(episode_id)
        try:
            done.append((episode_id, reconstruct_episode(bundle, trainable_roles=trainable_roles)))
        except (ReconstructionError, FormatError) as exc:
            report.refused[episode_id] = f"{type(exc).__name__}: {exc.message}"
        if progress is not None and task is not None:
            progress.advance(task)
    if not done:
        return
    export_name = f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    rows = [row for _, result in done for row in result.rows]
    rows_path = out_dir / f"rows-{export_name}.parquet"
    report_path = out_dir / f"report-{export_name}.json"
    _write_atomically(rows_path, lambda p: pq.write_table(rows_table(rows), p))
    accounting = {episode_id: result.accounting.to_dict() for episode_id, result in done}
    _write_atomically(
        report_path,
        lambda p: p.write_text(json.dumps({"episodes": accounting}, indent=2), encoding="utf-8"),
    )
    export_id = await store.exports.record_export(rows_path.name, len(rows), [e for e, _ in done])
    if export_id is None:  # another job claimed some of them first: ours is not the record
        rows_path.unlink()
        report_path.unlink()
        return
    report.exported_episodes += [e for e, _ in done]
    report.files.append(rows_path.name)
    report.rows += len(rows)


async def run_job(
    db_url: str,
    out_dir: Path,
    *,
    follow: bool = False,
    interval_s: float = 5.0,
    batch: int = 100,
    trainable_roles: frozenset[str] = DEFAULT_TRAINABLE_ROLES,
    show_progress: bool = True,
    stop: asyncio.Event | None = None,
) -> JobReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(db_url)
    store = Store(make_sessionmaker(engine))
    report = JobReport()
    stop = stop or asyncio.Event()
    try:
        report.orphans = await quarantine_orphans(store, out_dir)
        with Progress(disable=not show_progress, transient=True) as progress:
            while not stop.is_set():
                skip = list(report.refused)
                episode_ids = await store.exports.closed_unexported(limit=batch, skip=skip)
                if episode_ids:
                    await export_batch(
                        store, out_dir, episode_ids, trainable_roles, report, progress
                    )
                    continue
                if not follow:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)
    finally:
        await engine.dispose()
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="capture-proxy reconstruct", description=__doc__)
    parser.add_argument(
        "--db", required=True, help="store URL: sqlite:///path or postgresql://user@host/db"
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--follow", action="store_true", help="keep exporting until interrupted")
    parser.add_argument("--interval", type=float, default=5.0, help="poll interval with --follow")
    parser.add_argument("--batch", type=int, default=100, help="episodes per file")
    parser.add_argument("--trainable-roles", default=",".join(sorted(DEFAULT_TRAINABLE_ROLES)))
    args = parser.parse_args(argv)
    roles = frozenset(r.strip() for r in args.trainable_roles.split(",") if r.strip())

    async def _main() -> JobReport:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_job(
            args.db,
            args.out,
            follow=args.follow,
            interval_s=args.interval,
            batch=args.batch,
            trainable_roles=roles,
            show_progress=sys.stderr.isatty(),
            stop=stop,
        )

    report = asyncio.run(_main())
    for name in report.orphans:
        print(f"moved orphan file {name} (written but never recorded) to orphans/", file=sys.stderr)
    for episode_id, reason in report.refused.items():
        print(f"refused episode {episode_id}: {reason}", file=sys.stderr)
    print(
        json.dumps(
            {
                "exported_episodes": len(report.exported_episodes),
                "rows": report.rows,
                "files": report.files,
                "refused": report.refused,
            }
        )
    )
    return 0
