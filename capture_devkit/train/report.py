"""What the loop writes and shows: ``iterations.jsonl``, the reward curve PNG, a live table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ITERATIONS_FILE = "iterations.jsonl"
CURVE_FILE = "reward_curve.png"


def append_record(out: Path, record: dict[str, Any]) -> None:
    with (out / ITERATIONS_FILE).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def read_records(out: Path) -> list[dict[str, Any]]:
    path = out / ITERATIONS_FILE
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def progress_table(records: Sequence[dict[str, Any]], total: int, last: int = 12) -> Table:
    """The live display: one line per iteration (the latest ``last`` of them)."""
    table = Table(title=f"capture-proxy train: {len(records)}/{total} iterations", expand=False)
    for name in ("it", "reward", "min–max", "version", "ratio", "kl", "loss", "rows", "s"):
        table.add_column(name, justify="right")
    for r in records[-last:]:
        table.add_row(
            str(r["iteration"]),
            f"{r['reward_mean']:.3f}",
            f"{r['reward_min']:.2f}–{r['reward_max']:.2f}",
            ",".join(str(v) for v in r["weight_versions"]),
            f"{r['mean_ratio']:.4f}",
            f"{r['approx_kl']:.2e}",
            f"{r['loss']:+.4f}",
            str(r["rows"]),
            f"{sum(r['seconds'].values()):.1f}",
        )
    return table


def summary(records: Sequence[dict[str, Any]], window: int = 5) -> dict[str, float]:
    rewards = [r["reward_mean"] for r in records]
    first = rewards[:window]
    last = rewards[-window:]
    return {
        "first_mean": sum(first) / len(first) if first else 0.0,
        "last_mean": sum(last) / len(last) if last else 0.0,
        "iterations": float(len(rewards)),
    }


def print_summary(console: Console, records: Sequence[dict[str, Any]], out: Path) -> None:
    s = summary(records)
    console.print(
        f"mean reward, first 5 iterations {s['first_mean']:.3f} → last 5 {s['last_mean']:.3f}; "
        f"wrote {out / ITERATIONS_FILE} and {out / CURVE_FILE}"
    )


# -- the reward curve (Pillow: a plain line chart, no plotting library needed) ------------------


def plot_curves(
    path: Path, curves: dict[str, Sequence[float]], *, title: str = "mean reward per iteration"
) -> Path:
    """One line per curve (iteration on x, mean reward on y) written as a PNG."""
    from PIL import Image, ImageDraw

    width, height, margin = 720, 420, 56
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    values = [v for curve in curves.values() for v in curve] or [0.0]
    longest = max((len(c) for c in curves.values()), default=1)
    low, high = min(0.0, min(values)), max(values) * 1.05 or 1.0
    left, top, right, bottom = margin, margin // 2 + 10, width - margin // 2, height - margin

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (right - left) * (i / max(1, longest - 1))
        y = bottom - (bottom - top) * ((v - low) / (high - low))
        return x, y

    draw.rectangle((left, top, right, bottom), outline="black")
    for k in range(5):  # y grid and labels
        v = low + (high - low) * k / 4
        _, y = xy(0, v)
        draw.line((left, y, right, y), fill=(225, 225, 225))
        draw.text((6, y - 6), f"{v:.2f}", fill="black")
    for i in range(0, longest, max(1, longest // 10)):
        x, _ = xy(i, low)
        draw.text((x - 4, bottom + 6), str(i), fill="black")
    draw.text((left, 8), title, fill="black")
    draw.text((right - 60, bottom + 22), "iteration", fill="black")
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]
    colours += [(140, 86, 75), (227, 119, 194), (127, 127, 127), (23, 190, 207)]
    for n, (label, curve) in enumerate(curves.items()):
        colour = colours[n % len(colours)]
        points = [xy(i, v) for i, v in enumerate(curve)]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)
        draw.text((left + 8, top + 6 + 14 * n), f"-- {label}", fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
