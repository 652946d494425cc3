"""Which continuations go to the engine as stitched ids, and the body a plan sends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from capture_proxy.continuation import Continuations, Plan, rendered_by_engine
from capture_proxy.settings import Settings
from capture_proxy.stitch import Extends, PriorCall, Stitched
from capture_proxy.store.records import Generation
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

    stitched = asyncio.run(stitch())
    assert isinstance(stitched, Stitched)
    assert stitched.prompt_ids == [1, 2, 3, 4, _Renders.EOT, 7, 8, 8]
    full, head = engine.arrived
    assert full is body and "stream" not in head and len(head["messages"]) == 2
