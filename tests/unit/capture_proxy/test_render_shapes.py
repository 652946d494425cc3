"""What stitching learns per head shape: one render or two (capture_proxy/render_shapes.py).

The engine-facing side (which renders a stitch asks for, the cuts compared) is pinned down in
``test_continuation_plan.py`` with a template double; here, the bookkeeping alone.
"""

from __future__ import annotations

import logging

import pytest

from capture_proxy.render_shapes import MAX_SHAPES, RECHECK_EVERY, RenderShapes


def test_a_shape_not_seen_yet_takes_both_renders_and_learns() -> None:
    shapes = RenderShapes()
    assert shapes.renders("s", base_render_known=True) == (False, True)
    assert shapes.known("s") is None
    shapes.learn("s", agrees=True)
    assert shapes.known("s") is True
    assert shapes.renders("s", base_render_known=True) == (True, False)


def test_no_shape_takes_both_renders_and_learns_nothing() -> None:
    assert RenderShapes().renders(None, base_render_known=True) == (False, False)


def test_one_render_needs_the_base_calls_own_render() -> None:
    """Without the base's own render, one render cannot be checked to begin with it."""
    shapes = RenderShapes()
    shapes.learn("s", agrees=True)
    assert shapes.renders("s", base_render_known=False) == (False, False)


def test_a_shape_that_needs_two_renders_keeps_them_without_learning() -> None:
    shapes = RenderShapes()
    shapes.learn("s", agrees=False)
    assert [shapes.renders("s", True) for _ in range(3)] == [(False, False)] * 3


def test_every_so_many_one_render_stitches_one_checks_again() -> None:
    """Stitches 1 … RECHECK_EVERY-1 after learning take one render; the RECHECK_EVERY-th takes
    both and learns; an agreement there starts the count again."""
    shapes = RenderShapes()
    shapes.learn("s", agrees=True)
    first = [shapes.renders("s", True) for _ in range(RECHECK_EVERY)]
    assert first == [(True, False)] * (RECHECK_EVERY - 1) + [(False, True)]
    shapes.learn("s", agrees=True)
    again = [shapes.renders("s", True) for _ in range(RECHECK_EVERY)]
    assert again == first


def test_a_recheck_that_disagrees_is_a_warning_and_keeps_two_renders(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shapes = RenderShapes(recheck_every=2)
    shapes.learn("s", agrees=True)
    assert [shapes.renders("s", True) for _ in range(2)] == [(True, False), (False, True)]
    with caplog.at_level(logging.INFO, logger="capture_proxy.render_shapes"):
        shapes.learn("s", agrees=False)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "up to 1 stitched" in record.getMessage()
    assert shapes.known("s") is False
    assert shapes.renders("s", True) == (False, False)


def test_a_disagreement_sticks() -> None:
    """A stitch of the shape that agreed, learning at the same time, does not undo it; nor
    does dropping what is known when too many shapes are (only agreements are dropped)."""
    shapes = RenderShapes()
    shapes.learn("s", agrees=False)
    shapes.learn("s", agrees=True)
    assert shapes.known("s") is False
    for i in range(MAX_SHAPES - 1):
        shapes.learn(f"agrees-{i}", agrees=True)
    assert shapes.known("agrees-0") is True
    shapes.learn("one more", agrees=True)  # past the bound: the agreements are dropped
    assert (shapes.known("s"), shapes.known("agrees-0"), shapes.known("one more")) == (
        False,
        None,
        True,
    )


def test_past_the_bound_with_only_disagreements_a_shape_stays_unknown() -> None:
    shapes = RenderShapes(max_shapes=2)
    shapes.learn("a", agrees=False)
    shapes.learn("b", agrees=False)
    shapes.learn("c", agrees=True)
    assert (shapes.known("a"), shapes.known("b"), shapes.known("c")) == (False, False, None)
    assert shapes.renders("c", True) == (False, True)  # both renders, every time
