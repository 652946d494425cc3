"""Policy versions and grammar constraints travel from the bundle into the rows (formats.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_contracts.bundle import parse_bundle
from capture_contracts.errors import InvalidBundle
from reconstruct import reconstruct_episode
from tests.support.builders import EpisodeBuilder
from trainer_bridge.rows_io import read_rows, write_parquet

pytestmark = pytest.mark.unit


def _bundle() -> dict:
    b = EpisodeBuilder()
    first = b.call("c1", b.fresh(4), 3)  # a forced tool call (regex), served by version 2
    b.call("c2", [*first, *b.fresh(2)], 4)  # free text continuing it, version 3
    bundle = b.bundle()
    bundle["calls"][0].update(weight_version=2, constraint="regex")
    bundle["calls"][1].update(weight_version=3)
    return bundle


def test_bundle_round_trip_keeps_version_and_constraint() -> None:
    bundle = parse_bundle(_bundle())
    forced, free = bundle.calls
    assert (forced.weight_version, forced.constraint, forced.constrained) == (2, "regex", True)
    assert (free.weight_version, free.constraint, free.constrained) == (3, None, False)
    again = parse_bundle(bundle.to_dict())
    assert [c.to_dict() for c in again.calls] == [c.to_dict() for c in bundle.calls]
    assert "constraint" not in again.calls[1].to_dict()


def test_old_bundles_have_no_version() -> None:
    data = _bundle()
    for call in data["calls"]:
        del call["weight_version"]
        call.pop("constraint", None)
    assert all(c.weight_version is None and not c.constrained for c in parse_bundle(data).calls)


@pytest.mark.parametrize(
    ("field", "value"), [("weight_version", -1), ("weight_version", "2"), ("constraint", "xml")]
)
def test_bad_version_or_constraint_is_refused(field: str, value: object) -> None:
    data = _bundle()
    data["calls"][0][field] = value
    with pytest.raises(InvalidBundle, match=field):
        parse_bundle(data)


def test_rows_carry_versions_and_constrained_positions(tmp_path: Path) -> None:
    (row,) = reconstruct_episode(_bundle()).rows
    assert [(s.call_id, s.weight_version, s.constrained) for s in row.spans] == [
        ("c1", 2, True),
        ("c2", 3, False),
    ]
    constrained, versions = row.position_masks()
    c1, c2 = row.spans
    assert constrained.tolist() == [int(c1.start <= i < c1.end) for i in range(len(row.input_ids))]
    assert versions[c1.start : c1.end].tolist() == [2] * (c1.end - c1.start)
    assert versions[c2.start : c2.end].tolist() == [3] * (c2.end - c2.start)
    assert versions[: c1.start].tolist() == [-1] * c1.start
    # Parquet keeps them (and spans without them read back as the defaults).
    write_parquet([row], tmp_path / "rows.parquet")
    (back,) = read_rows(tmp_path / "rows.parquet")
    assert back.to_dict() == row.to_dict()
