"""Which continuations go to the engine as stitched ids, and the body a plan sends."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from capture_contracts.bundle import ContinuationRecord
from capture_devkit.tiny_model import build_tiny_model
from capture_proxy.chat_template import ChatTemplate, _conversation
from capture_proxy.continuation import (
    Continuations,
    Plan,
    _prior,
    rendered_by_engine,
)
from capture_proxy.render_shapes import RECHECK_EVERY, LocalShapes
from capture_proxy.settings import Settings
from capture_proxy.stitch import Extends, OwnRender, PriorCall, Priors, Stitched
from capture_proxy.store.records import CompletedChatCall, Generation
from capture_proxy.upstream.client import UpstreamReply


def _body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "content",
    [
        "plain text",
        [{"type": "text", "text": "a"}, {"text": "b"}],
        [{"type": "input_text", "text": "a"}, {"type": "thinking", "thinking": "t"}],
        None,
    ],
)
def test_text_messages_can_be_stitched(content: Any) -> None:
    assert rendered_by_engine(_body(USER, {"role": "assistant", "content": content})) is None


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": "a", "image_url": {"url": "x"}},  # media whatever the type
        {"type": "something_new"},
        "not a part",
    ],
)
def test_non_text_content_is_rendered_by_the_engine(part: Any) -> None:
    body = _body(USER, {"role": "user", "content": [{"type": "text", "text": "a"}, part]})
    assert rendered_by_engine(body) == "media_content"


def test_echo_is_rendered_by_the_engine() -> None:
    assert rendered_by_engine(_body(USER, echo=True)) == "echo"
    assert rendered_by_engine(_body(USER, echo=False)) is None


def test_a_plan_sends_its_stitched_body_or_the_prepared_one() -> None:
    prepared = _body(USER)
    assert Plan(None).upstream_body(prepared) is prepared
    stitched = prepared | {"kv_transfer_params": {"prompt_token_ids": [1, 2]}}
    assert Plan(None, body=stitched).upstream_body(prepared) is stitched


def test_an_engine_that_ignored_the_stitched_ids_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    continuations = Continuations(Settings(), None, None)  # type: ignore[arg-type]
    plan = Plan(None, prefix_hash="h", body={"kv_transfer_params": {"prompt_token_ids": [1, 2]}})
    same = Generation([1, 2], [3], [-0.1], "stop")
    with caplog.at_level(logging.WARNING, logger="capture_proxy.continuation"):
        [hashed] = continuations.replies(plan, [same], {"choices": [{"message": {}}]})
        assert hashed.reply_hash and not caplog.records
        other = Generation([1, 9, 2], [3], [-0.1], "stop")
        for _ in range(2):
            continuations.replies(plan, [other], {"choices": [{"message": {}}]})
    assert len(caplog.records) == 1 and "stitched prompt ids" in caplog.text


class _Renders:
    """An engine double whose renders each wait until both have arrived (a stitch that sent
    them one after the other would wait forever), and a store double with the base's tokens."""

    EOT = 9

    def __init__(self) -> None:
        self.arrived: list[dict[str, Any]] = []
        self.both = asyncio.Event()

    async def render_chat(self, body: dict[str, Any]) -> UpstreamReply:
        self.arrived.append(body)
        if len(self.arrived) == 2:
            self.both.set()
        await self.both.wait()
        head = [1, 2, 5, self.EOT, 7]  # history, canonical reply, end of turn, trailer
        ids = head if body.get("add_generation_prompt") is False else [*head, 8, 8]
        return UpstreamReply(200, {"token_ids": ids})

    async def post_json(self, path: str, body: dict[str, Any]) -> UpstreamReply:
        return UpstreamReply(200, {"tokens": [self.EOT]})

    async def call_tokens(self, call_id: str) -> tuple[list[int], list[int]]:
        await self.both.wait()
        return [1, 2], [3, 4, self.EOT]  # the base's exact prompt and sampled ids


def test_the_two_renders_and_the_base_tokens_are_asked_for_at_once() -> None:
    engine = _Renders()
    continuations = Continuations(Settings(), engine, engine)  # type: ignore[arg-type]
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "")
    body = _body(USER, {"role": "assistant", "content": "x"}, USER, stream=True)

    async def stitch() -> Any:
        return await asyncio.wait_for(continuations._stitch(body, Extends(base)), 5)

    stitched, renders, _ = asyncio.run(stitch())
    assert isinstance(stitched, Stitched) and renders == 2
    assert stitched.prompt_ids == [1, 2, 3, 4, _Renders.EOT, 7, 8, 8]
    full, head = engine.arrived
    assert full is body and "stream" not in head and len(head["messages"]) == 2


class _Template:
    """An engine double that renders like a chat template: per message its role's token, its
    text (one id per character), end of turn and a newline; the generation prompt is the
    assistant token. ``split_calls``: an assistant message's tool calls are a turn of their own
    (two end-of-turn tokens in one message's rendering, which one render cannot tell apart)."""

    EOT, NL, ASSISTANT = 9, 5, 7
    ROLES: ClassVar[dict[str, int]] = {"system": 1, "user": 2, "tool": 3, "assistant": 7}

    def __init__(
        self, base_prompt: list[int], *, split_calls: bool = False, mark_last: bool = False
    ) -> None:
        self.base_prompt = base_prompt
        self.split_calls = split_calls
        self.mark_last = mark_last  # the last assistant turn opens with 30, 31 (Qwen3's block)
        self.renders: list[bool] = []  # add_generation_prompt of each render asked for

    def message(self, message: dict[str, Any]) -> list[int]:
        text = [100 + ord(c) % 50 for c in message.get("content") or ""]
        ids = [self.ROLES[message["role"]], *text, self.EOT, self.NL]
        for call in message.get("tool_calls") or []:
            args = [150 + ord(c) % 50 for c in call["function"]["arguments"]]
            ids = (
                [*ids[:-2], *args, self.EOT, self.NL]
                if not self.split_calls
                else [*ids, 8, *args, self.EOT, self.NL]
            )
        return ids

    async def render_chat(self, body: dict[str, Any]) -> UpstreamReply:
        generation = body.get("add_generation_prompt", True)
        self.renders.append(generation)
        messages = body["messages"]
        ids = [t for m in messages for t in self.message(m)]
        if self.mark_last and not generation and messages[-1]["role"] == "assistant":
            last = len(self.message(messages[-1]))
            ids[-last + 1 : -last + 1] = [30, 31]
        return UpstreamReply(200, {"token_ids": ids + [self.ASSISTANT] * generation})

    async def post_json(self, path: str, body: dict[str, Any]) -> UpstreamReply:
        return UpstreamReply(200, {"tokens": [self.EOT]})

    async def call_tokens(self, call_id: str) -> tuple[list[int], list[int]]:
        return self.base_prompt, [40, 41, self.EOT]  # sampled: not the canonical split


ASKED = {"role": "user", "content": "count"}
CALLED = {
    "role": "assistant",
    "content": "ok",
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c", "content": "3"}


def _stitch_twice(engine: _Template, base: PriorCall) -> list[tuple[Stitched, int]]:
    continuations = Continuations(Settings(), engine, engine)  # type: ignore[arg-type]
    body = _body(ASKED, CALLED, RESULT, temperature=1.0)

    async def stitch() -> list[tuple[Stitched, int]]:
        out = []
        for request in (body, body | {"seed": 3}):  # (a sampling field: the same head shape)
            stitched = await continuations._stitch(request, Extends(base))
            assert not isinstance(stitched, str), stitched
            out.append(stitched[:2])
        return out

    return asyncio.run(stitch())


def _expected(engine: _Template, base_prompt: list[int]) -> list[int]:
    """Base prompt + sampled ids + what follows the reply in the full render (two renders)."""
    tail = [engine.NL, *engine.message(RESULT), engine.ASSISTANT]
    return [*base_prompt, 40, 41, engine.EOT, *tail]


def test_a_head_shape_shown_to_need_no_head_render_takes_one_render() -> None:
    """The first stitch of a head shape asks for both renders and learns that the full render
    alone cuts at the same place; the next of that shape asks for the full render only, and its
    ids are the same. The base's own render is its prompt here (it was rendered fresh)."""
    engine = _Template([])
    engine.base_prompt = [*engine.message(ASKED), engine.ASSISTANT]
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)
    (first, renders_1), (second, renders_2) = _stitch_twice(engine, base)
    assert (renders_1, renders_2) == (2, 1) and engine.renders == [True, False, True]
    assert first.prompt_ids == second.prompt_ids == _expected(engine, engine.base_prompt)


def test_a_stitched_base_is_known_by_the_digest_of_its_own_render() -> None:
    """A stitched base's prompt is not the engine's render of its request: the full render is
    compared with the render it was stitched from, kept as a length and a digest."""
    engine = _Template([])
    own = [*engine.message(ASKED), engine.ASSISTANT]
    engine.base_prompt = [2, 111, 112, 9, 5, 7]  # exact ids of an earlier stitch: not `own`
    base = PriorCall("c", 1, "parent", 1, "p", "r", "", render=OwnRender.of(own))
    (first, renders_1), (second, renders_2) = _stitch_twice(engine, base)
    assert (renders_1, renders_2) == (2, 1)
    assert first.prompt_ids == second.prompt_ids == _expected(engine, engine.base_prompt)
    # without a known own render (a record from before renders were marked): two renders
    engine.renders.clear()
    unknown = PriorCall("c", 1, "parent", 1, "p", "r", "")
    assert [r for _, r in _stitch_twice(engine, unknown)] == [2, 2]


def test_a_template_the_one_render_cut_gets_wrong_keeps_the_head_render() -> None:
    """Tool calls rendered as a turn of their own: the reply's rendering holds two end-of-turn
    tokens. The first stitch sees the cuts disagree, so that shape keeps both renders, and every
    stitch is the two renders' (the one-render cut would have dropped the tool call)."""
    engine = _Template([], split_calls=True)
    engine.base_prompt = [*engine.message(ASKED), engine.ASSISTANT]
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)
    (first, renders_1), (second, renders_2) = _stitch_twice(engine, base)
    assert (renders_1, renders_2) == (2, 2) and engine.renders == [True, False] * 2
    assert first.prompt_ids == second.prompt_ids == _expected(engine, engine.base_prompt)


def test_a_full_render_without_the_base_render_asks_for_the_head_after_it() -> None:
    """The shape is known, but the full render does not begin with the base's own render (the
    history renders otherwise now): the head render is asked for after all."""
    engine = _Template([])
    engine.base_prompt = [*engine.message(ASKED), engine.ASSISTANT]
    continuations = Continuations(Settings(), engine, engine)  # type: ignore[arg-type]
    body = _body(ASKED, CALLED, RESULT)
    fresh = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)
    other = PriorCall("call-1", 1, "parent", 1, "p", "r", "", render=OwnRender.of([2, 7]))

    async def stitch() -> list[Any]:
        return [await continuations._stitch(body, Extends(b)) for b in (fresh, other)]

    (learned, renders_1, _), (after, renders_2, _) = asyncio.run(stitch())
    assert (renders_1, renders_2) == (2, 2) and engine.renders == [True, False, True, False]
    assert learned.prompt_ids == after.prompt_ids


def test_a_shape_is_checked_again_every_so_many_stitches(caplog: pytest.LogCaptureFixture) -> None:
    """Learned right, a shape is still checked with both renders every ``RECHECK_EVERY``
    stitches: a template that turns out to render these replies otherwise (here it starts
    rendering tool calls as a turn of their own) is caught there, and the shape keeps both
    renders from then on, every stitch the two renders' again."""
    engine = _Template([])
    engine.base_prompt = [*engine.message(ASKED), engine.ASSISTANT]
    continuations = Continuations(Settings(), engine, engine)  # type: ignore[arg-type]
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)
    body = _body(ASKED, CALLED, RESULT)

    async def stitches(calls: int) -> list[tuple[list[int], int]]:
        out = []
        for _ in range(calls):
            stitched = await continuations._stitch(body, Extends(base))
            assert not isinstance(stitched, str)
            out.append((stitched[0].prompt_ids, stitched[1]))
        return out

    learned = asyncio.run(stitches(RECHECK_EVERY + 1))
    assert [r for _, r in learned] == [2] + [1] * (RECHECK_EVERY - 1) + [2]  # one recheck
    assert all(ids == _expected(engine, engine.base_prompt) for ids, _ in learned)
    engine.split_calls = True
    with caplog.at_level(logging.WARNING, logger="capture_proxy.render_shapes"):
        rechecked = asyncio.run(stitches(RECHECK_EVERY + 2))
    assert len(caplog.records) == 1 and "recheck found the one-render cut wrong" in caplog.text
    # one render until the next check (those cuts are wrong now), then both renders for good
    assert [r for _, r in rechecked] == [1] * (RECHECK_EVERY - 1) + [2, 2, 2]
    assert rechecked[0][0] != _expected(engine, engine.base_prompt)
    assert all(ids == _expected(engine, engine.base_prompt) for ids, _ in rechecked[-3:])


def test_where_two_renders_fall_back_one_render_is_never_taken() -> None:
    """A template that marks the last assistant turn (Qwen3's empty reasoning block): the head
    is not a prefix of the full render, so the two renders fall back to a fresh render. One
    render would have stitched; that counts as a disagreement, and the shape keeps both renders
    even where a later call's renders would agree."""
    engine = _Template([], mark_last=True)
    engine.base_prompt = [*engine.message(ASKED), engine.ASSISTANT]
    continuations = Continuations(Settings(), engine, engine)  # type: ignore[arg-type]
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)
    body = _body(ASKED, CALLED, RESULT)

    async def stitch() -> Any:
        return await continuations._stitch(body, Extends(base))

    assert asyncio.run(stitch()) == "template_not_prefix_stable"
    engine.mark_last = False
    outcomes = [asyncio.run(stitch()) for _ in range(3)]
    assert [o[1] for o in outcomes] == [2, 2, 2]
    assert engine.renders == [True, False] * 4


@pytest.mark.parametrize(
    ("record", "rendered_prompt", "render"),
    [
        (ContinuationRecord(False, mode="stitch"), True, None),  # rendered fresh
        (ContinuationRecord(True, renders=1, render_len=3, render_digest="d"), False, (3, "d")),
        (ContinuationRecord(True, renders=2), False, None),  # (a record from before the marks)
        # prefilled (continue_final_message): the render ends inside a message, never a cut
        (ContinuationRecord(False, prefilled=True), False, None),
        (ContinuationRecord(True, render_len=3, render_digest="d", prefilled=True), False, None),
    ],
)
def test_what_a_recorded_call_offers_a_later_cut(
    record: ContinuationRecord, rendered_prompt: bool, render: tuple[int, str] | None
) -> None:
    """Read from the store (``_prior``) or just completed here (``remember``), the same."""
    record = replace(record, messages=1, prefix_hash="p")
    stored = _prior(CompletedChatCall("c", 1, "policy", record, "r"))
    continuations = Continuations(Settings(), None, None)  # type: ignore[arg-type]
    continuations._priors[("e", "a")] = Priors()
    continuations.remember("e", "a", "policy", Plan(record), ["c"], [_GEN], [1])
    remembered = continuations._priors[("e", "a")].latest
    for prior in (stored, remembered):
        assert prior is not None and prior.rendered_prompt is rendered_prompt
        assert prior.render == (OwnRender(*render) if render else None)


_GEN = Generation([1, 2], [3], [-0.1], "stop", reply_hash="r")


def test_a_prefilled_request_is_recorded_so() -> None:
    continuations = Continuations(Settings(), None, None)  # type: ignore[arg-type]
    final = {"role": "assistant", "content": "The answer is"}

    async def plan(**fields: Any) -> ContinuationRecord | None:
        return (await continuations.plan("e", "chat", "a", _body(USER, final, **fields))).record

    store = _NoCalls()
    continuations.store = store  # type: ignore[assignment]
    assert asyncio.run(plan(continue_final_message=True, add_generation_prompt=False)).prefilled
    assert asyncio.run(plan(add_generation_prompt=False)).prefilled
    assert asyncio.run(plan()).prefilled is None


class _NoCalls:
    """A store double with no recorded calls (the agent's first call continues none)."""

    def changes_elsewhere(self) -> int | None:
        return None

    async def chat_calls_since(self, *args: Any) -> list[Any]:
        return []


class _TemplateEngine:
    """An engine double that renders with the tiny model's real template and tokenizer (as
    vLLM does: the whole text, encoded), counting its renders; ``extra``: ids it adds to every
    full render (an engine whose template differs from the proxy's)."""

    def __init__(self, template: ChatTemplate, extra: tuple[int, ...] = ()) -> None:
        self.template = template
        self.extra = list(extra)
        self.renders = 0

    async def render_chat(self, body: dict[str, Any]) -> UpstreamReply:
        self.renders += 1
        conversation = _conversation(body["messages"])
        assert conversation is not None
        generation = body.get("add_generation_prompt", True)
        text = self.template.render(conversation, None, generation_prompt=generation)
        ids = self.template._tokenizer.encode(text, add_special_tokens=False).ids
        return UpstreamReply(200, {"token_ids": ids + (self.extra if generation else [])})

    async def post_json(self, path: str, body: dict[str, Any]) -> UpstreamReply:
        return UpstreamReply(200, {"tokens": [self.template.end_of_turn_id]})

    async def call_tokens(self, call_id: str) -> tuple[list[int], list[int]]:
        return [1, 2, 3], [4, 5]  # the base's exact ids (not the template's: sampled)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("agrees", [True, False])
def test_a_head_shape_is_rendered_in_the_proxy_once_it_agreed_with_the_engine(
    tiny_dir: Path, agrees: bool
) -> None:
    """The first stitch of a shape takes the engine's renders and compares the proxy's; from
    then on a shape that agreed takes none (``renders`` 0) and gives the same ids, every
    ``recheck_every``-th one comparing again; one that disagreed stays on the engine."""
    settings = Settings(continuation_template_dir=tiny_dir)
    template = ChatTemplate.load(tiny_dir, "<|im_end|>")
    engine = _TemplateEngine(template, () if agrees else (7,))
    continuations = Continuations(settings, engine, engine)  # type: ignore[arg-type]
    continuations.ids.local_shapes = LocalShapes(recheck_every=3)
    base = PriorCall("call-1", 1, "parent", 1, "p", "r", "", rendered_prompt=True)

    def stitch(question: str) -> tuple[Any, int, Any, int]:
        body = _body(USER, {"role": "assistant", "content": "x"}, USER | {"content": question})
        before = engine.renders
        out = asyncio.run(continuations._stitch(body, Extends(base)))
        assert not isinstance(out, str)
        return *out, engine.renders - before

    first, renders, _, asked = stitch("one?")
    assert (renders, asked) == (2, 2)
    runs = [stitch(question) for question in ("two?", "three?", "four?")]
    if agrees:
        assert [(r[1], r[3]) for r in runs] == [(0, 0), (0, 0), (2, 2)]  # (the third rechecks)
        here = runs[0][0]
        tail = template.continuation_ids(
            _body(USER, {"role": "assistant", "content": "x"}, USER | {"content": "two?"}), 1
        )
        assert here.prompt_ids == [1, 2, 3, 4, 5, template.end_of_turn_id, *(tail or [])]
        assert here.prompt_ids[: first.base_len] == first.prompt_ids[: first.base_len]
    else:
        assert all(r[1] > 0 and r[3] > 0 for r in runs)  # (the engine renders every one)
        assert runs[0][0].prompt_ids[-1] == 7
