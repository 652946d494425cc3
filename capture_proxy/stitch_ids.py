"""Where a stitched call's ids come from: the engine's renders, or the proxy's own render of the
model's chat template (:mod:`capture_proxy.chat_template`), each learned per head shape.

:class:`StitchIds` is what :class:`~capture_proxy.continuation.Continuations` asks once it has
chosen the call a request extends: the stitched ids (:mod:`capture_proxy.stitch`), how many of
the engine's renders they took (0: rendered in the proxy), and the mark of the full render.
"""

from __future__ import annotations

import asyncio
from typing import Any

from capture_contracts.vocabulary import FallbackReason
from capture_proxy.chat_template import ChatTemplate
from capture_proxy.render_shapes import LocalShapes, RenderShapes
from capture_proxy.settings import Settings
from capture_proxy.stitch import (
    Fresh,
    OwnRender,
    PriorCall,
    Stitched,
    head_shape,
    stitch_here,
    stitch_on_render,
    stitch_prompt,
)
from capture_proxy.store.repository import Store
from capture_proxy.upstream import TOKENIZE, Upstream

#: Statuses with which vLLM refuses the scale-out routes when they are not enabled.
_UNAVAILABLE = {403, 404, 405, 501}
_STREAM_ONLY = ("stream", "stream_options", "stream_interval")


class TokenPathUnavailable(Exception):
    """The engine has no render route (vLLM without ``--enable-scale-out``) or no tokenize
    route: the call is sent as prepared (``token_path_unavailable``)."""


def _own_end(
    base: PriorCall, prompt: list[int], full_ids: list[int]
) -> tuple[int | None, OwnRender]:
    """Where the base call's own render ends in ``full_ids`` (None: ``full_ids`` does not
    begin with it, or it is not known), and the mark of ``full_ids``."""
    own = base.render
    if base.rendered_prompt or own is None:
        n = len(prompt)
        begins = base.rendered_prompt and full_ids[:n] == prompt
        return (n if begins else None), OwnRender.of(full_ids)
    begins = own.length <= len(full_ids) and OwnRender.of(full_ids[: own.length]) == own
    return (own.length if begins else None), OwnRender.of(full_ids)


class StitchIds:
    """The engine's renders and the proxy's, and what is learned of them per head shape."""

    def __init__(self, settings: Settings, store: Store, upstream: Upstream) -> None:
        self.end_of_turn = settings.end_of_turn_token
        self.store = store
        self.upstream = upstream
        self._eot_id: int | None = None
        self.shapes = RenderShapes()  # per head shape: one render or two (learned)
        found = settings.continuation_template_dir
        self.template = None if found is None else ChatTemplate.load(found, self.end_of_turn)
        self.local_shapes = LocalShapes()  # per head shape: rendered here or by the engine

    async def _render(self, body: dict[str, Any]) -> dict[str, Any] | None:
        reply = await self.upstream.render_chat(body)
        if reply.status_code in _UNAVAILABLE:
            raise TokenPathUnavailable
        if reply.status_code >= 400 or not isinstance(reply.body, dict):
            return None
        return reply.body

    async def _end_of_turn_id(self, model: Any) -> int:
        if self._eot_id is None:
            reply = await self.upstream.post_json(
                TOKENIZE, {"model": model, "prompt": self.end_of_turn, "add_special_tokens": False}
            )
            tokens = reply.body.get("tokens") if isinstance(reply.body, dict) else None
            if reply.status_code >= 400 or not tokens or len(tokens) != 1:
                raise TokenPathUnavailable
            self._eot_id = int(tokens[0])
        return self._eot_id

    async def stitch(
        self, body: dict[str, Any], base: PriorCall
    ) -> tuple[Stitched, int, OwnRender | None] | FallbackReason:
        """The stitched ids, the number of the engine's renders they took (0: rendered here)
        and the full render's mark (None: rendered here, no mark).

        With the model's chat template at hand (``continuation_template_dir``), a head shape
        whose render here has agreed with the engine's is rendered here alone: no request to
        the engine but the call itself. A shape not seen yet (and every
        :data:`~capture_proxy.render_shapes.RECHECK_EVERY`-th of one that agreed) is rendered
        by both, and the engine's ids are used and compared (:class:`LocalShapes`).
        """
        shape = head_shape(body, base.messages, self.end_of_turn)
        here: list[int] | None = None
        learning = False
        if self.template is not None and shape is not None:
            alone, learning = self.local_shapes.renders(shape, True)
            if alone or learning:
                here = self.template.continuation_ids(body, base.messages)
            if alone and here is not None:
                prompt, completion = await self.store.call_tokens(base.call_id)
                eot = self.template.end_of_turn_id
                return stitch_here(prompt, completion, eot, here), 0, None
        outcome = await self._stitch_on_engine(body, base, shape)
        if learning and here is not None and shape is not None and self.template is not None:
            if isinstance(outcome, tuple):
                stitched = outcome[0]
                same_eot = self._eot_id == self.template.end_of_turn_id
                agrees = same_eot and stitched.prompt_ids[stitched.base_len :] == here
                self.local_shapes.learn(shape, agrees)
            elif outcome == "template_not_prefix_stable":
                self.local_shapes.learn(shape, False)
        return outcome

    async def _stitch_on_engine(
        self, body: dict[str, Any], base: PriorCall, shape: str | None
    ) -> tuple[Stitched, int, OwnRender] | FallbackReason:
        """:meth:`stitch` on the engine's renders.

        The renders and the base call's tokens are asked for at once: under load the engine's
        API server queues each request behind the streams it serves, so one wait instead of
        several keeps the call's latency (and, at a fixed number of agents, the engine's batch)
        closer to a direct call's. Where the head's shape is known to need no head render (and
        the base's own render is known), only the full render is asked for; should the full
        render not begin with the base's own, the head render follows.
        """
        base_render_known = base.rendered_prompt or base.render is not None
        one, learning = self.shapes.renders(shape, base_render_known)
        whole = {k: v for k, v in body.items() if k not in _STREAM_ONLY}
        head_body = whole | {
            "messages": body["messages"][: base.messages + 1],
            "add_generation_prompt": False,
            "continue_final_message": False,
        }
        asked = [self._render(body)] if one else [self._render(body), self._render(head_body)]
        found = await asyncio.gather(
            self.store.call_tokens(base.call_id),  # one key read
            self._end_of_turn_id(body.get("model")),
            *asked,
        )  # (a failure raises at once; gather retrieves the others' outcomes itself)
        (prompt, completion), eot, full, *heads = found
        if full is None:
            return "render_failed"
        full_ids: list[int] = full["token_ids"]
        own_end, mark = _own_end(base, prompt, full_ids)
        on_render = None
        if own_end is not None and (one or learning):
            on_render = stitch_on_render(prompt, completion, eot, own_end, full_ids)
        if one and on_render is not None:
            return on_render, 1, mark
        head = heads[0] if heads else await self._render(head_body)
        if head is None:
            return "render_failed"
        stitched = stitch_prompt(prompt, completion, eot, head["token_ids"], full_ids)
        if learning and shape is not None and on_render is not None:
            # (two renders that fall back, where one would have stitched, disagree too)
            two = stitched.prompt_ids if isinstance(stitched, Stitched) else None
            self.shapes.learn(shape, on_render.prompt_ids == two)
        if isinstance(stitched, Fresh):
            return stitched.reason
        return stitched, 2, mark
