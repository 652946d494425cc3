"""What stitching learns of the chat template, per head shape: whether one render is enough
(:class:`RenderShapes`), and whether the proxy's own render gives the engine's ids
(:class:`LocalShapes`).

A stitched call needs the point where the appended messages begin in the engine's render of the
whole request. Two renders give it for any template (the whole request's, and the head's: the
messages up to the continued reply). One render gives it where the template renders an
assistant message the same way whether it is the last one or not (:func:`~capture_proxy.stitch.
stitch_on_render`) — a property of the template that :func:`~capture_proxy.stitch.head_shape`
names the request's part in, and that is learned here, never assumed:

- A shape not seen yet takes both renders, and the stitch *learns*: the one-render cut agreeing
  with the two-render cut marks the shape as needing one render, a disagreement as needing two.
- A shape marked one-render takes one render (when the base call's own render is known), except
  every :data:`RECHECK_EVERY`-th stitch, which takes both again and learns again.
- A disagreement sticks: a stitch of the shape learning at the same time that agreed does not
  undo it, nor does the bound (:data:`MAX_SHAPES`; past it, the agreements are dropped and
  learned again). A shape that was right and is found wrong on a recheck is logged as a warning.

Pure and per process: no I/O; :class:`~capture_proxy.continuation.Continuations` keeps one of
each.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Head shapes whose one-render cut is known, kept per process; past this many, those known to
#: agree are dropped and learned again (a disagreement is kept).
MAX_SHAPES = 4096
#: Of a shape's stitches on one render, every this many-th takes both renders again and checks
#: the cut (a template whose rendering of a reply depends on more than its shape shows there).
RECHECK_EVERY = 32


class RenderShapes:
    """Per head shape: whether the one-render cut gave the two renders' ids (learned), and how
    many of its stitches took one render since it was last checked."""

    __slots__ = ("_max_shapes", "_one_render", "_recheck_every", "_unchecked")

    _FOUND_WRONG = (
        "a recheck found the one-render cut wrong for a head shape it had been right for: the"
        " chat template renders these replies by more than their shape. Calls of this shape"
        " take both renders from now on (up to %d stitched since the last check may have been"
        " cut otherwise; shape %s)"
    )
    _DISAGREES = (
        "the chat template renders an assistant message differently when it is not the last"
        " one: calls of this shape keep the head render (shape %s)"
    )

    def __init__(self, max_shapes: int = MAX_SHAPES, recheck_every: int = RECHECK_EVERY) -> None:
        self._max_shapes = max_shapes
        self._recheck_every = recheck_every
        self._one_render: dict[str, bool] = {}
        self._unchecked: dict[str, int] = {}

    def known(self, shape: str) -> bool | None:
        """True: one render suffices; False: two are needed; None: not learned (or dropped)."""
        return self._one_render.get(shape)

    def renders(self, shape: str | None, base_render_known: bool) -> tuple[bool, bool]:
        """``(one, learning)`` for a stitch of ``shape``: ask for the whole render only, and
        whether this stitch (taking both renders) is to :meth:`learn` from comparing the cuts.

        ``shape`` None: no shape (two renders, nothing learned). ``base_render_known``: the
        base call's own render is known (its prompt was the engine's render, or its record keeps
        the render's mark), without which one render cannot be checked to begin with it.
        """
        if shape is None:
            return False, False
        known = self._one_render.get(shape)
        if known is None:
            return False, True
        if not known or not base_render_known:
            return False, False
        unchecked = self._unchecked[shape] = self._unchecked.get(shape, 0) + 1
        if unchecked >= self._recheck_every:
            return False, True
        return True, False

    def learn(self, shape: str, agrees: bool) -> None:
        """What a stitch that took both renders showed: whether the one-render cut agreed."""
        was = self._one_render.get(shape)
        agrees = agrees and was is not False
        if was is None and len(self._one_render) >= self._max_shapes:
            self._one_render = {k: v for k, v in self._one_render.items() if v is False}
            self._unchecked.clear()
            if len(self._one_render) >= self._max_shapes:
                return  # (not kept: the shape stays unknown, every stitch takes both renders)
        self._one_render[shape] = agrees
        self._unchecked[shape] = 0
        if was and not agrees:
            log.warning(self._FOUND_WRONG, self._recheck_every - 1, shape)
        elif not agrees:
            log.info(self._DISAGREES, shape)


class LocalShapes(RenderShapes):
    """Per head shape: whether the proxy's own render (:mod:`capture_proxy.chat_template`) gave
    the ids of the engine's renders — learned as :class:`RenderShapes` learns the one-render
    cut: a shape not seen yet is rendered by both and compared; one that agreed is rendered here
    alone, but for every :data:`RECHECK_EVERY`-th stitch, which is compared again; a
    disagreement sticks. ``renders(shape, True)`` answers ``(here, learning)``."""

    __slots__ = ()

    _FOUND_WRONG = (
        "a recheck found the proxy's render of the chat template different from the engine's"
        " for a head shape it had agreed on: calls of this shape are rendered by the engine"
        " from now on (up to %d stitched since the last check were rendered here; shape %s)"
    )
    _DISAGREES = (
        "the proxy's render of the chat template differs from the engine's (another template"
        " or tokenizer on the server, or a template reading more than the proxy replicates):"
        " calls of this shape are rendered by the engine (shape %s)"
    )
