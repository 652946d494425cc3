"""Stitching decisions and the stitched prompt, on hand-made messages and token sequences."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.message_chain import chain, tools_hash
from capture_proxy.stitch import (
    Extends,
    Fresh,
    OwnRender,
    PriorCall,
    Priors,
    ReplyAccumulator,
    Stitched,
    choose_base,
    head_shape,
    render_digest,
    reply_message,
    stitch_on_render,
    stitch_prompt,
)

EOT = 9  # the end-of-turn id of these hand-made sequences
NL = 5  # the template's trailer after it

SYSTEM: dict[str, Any] = {"role": "system", "content": "sys"}
USER: dict[str, Any] = {"role": "user", "content": "count"}
CALL = {"id": "x1", "type": "function", "function": {"name": "look", "arguments": '{"shelf": 1}'}}
REPLY: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT: dict[str, Any] = {"role": "tool", "tool_call_id": "x1", "content": "3 fruits"}
TOOLS = tools_hash({"tools": [{"type": "function", "function": {"name": "look"}}]})


def prior(
    call_id: str,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    *,
    seq: int = 1,
    role: str = "policy",
    tools: str = TOOLS,
) -> PriorCall:
    hashes = chain([*messages, reply])
    return PriorCall(call_id, seq, role, len(messages), hashes[-2], hashes[-1], tools)


def test_first_call_is_a_root() -> None:
    assert choose_base([], chain([SYSTEM, USER]), TOOLS) == Fresh("no_previous_call")


def test_extension_picks_longest_then_latest() -> None:
    first = prior("c1", [SYSTEM, USER], REPLY, seq=2)
    history = [SYSTEM, USER, REPLY, RESULT]
    second = prior("c2", history, {"role": "assistant", "content": "done"}, seq=4)
    again = prior("c2b", history, {"role": "assistant", "content": "done"}, seq=6)
    request = [*history, {"role": "assistant", "content": "done"}, USER]
    assert choose_base([first, second, again], chain(request), TOOLS) == Extends(again)
    assert choose_base([first], chain(history), TOOLS) == Extends(first)


def test_tool_choice_does_not_change_the_tools_hash() -> None:
    """``tool_choice`` changes decoding, not the rendered prompt: a compaction call that keeps
    the tools with ``tool_choice: "none"`` still extends the agent's tokens."""
    tools = [{"type": "function", "function": {"name": "look"}}]
    assert tools_hash({"tools": tools, "tool_choice": "none"}) == TOOLS
    assert tools_hash({"tools": tools, "tool_choice": "auto"}) == TOOLS
    assert tools_hash({"tool_choice": "none"}) != TOOLS
    first = prior("c1", [SYSTEM, USER], REPLY)
    summarise = {"role": "user", "content": "Summarise."}
    compact = chain([SYSTEM, USER, REPLY, RESULT, summarise])
    none_hash = tools_hash({"tools": tools, "tool_choice": "none"})
    assert choose_base([first], compact, none_hash) == Extends(first)


def test_edited_assistant_tools_changed_compaction_and_unrelated() -> None:
    first = prior("c1", [SYSTEM, USER], REPLY)
    edited = {"role": "assistant", "content": "I looked."}
    assert choose_base([first], chain([SYSTEM, USER, edited, USER]), TOOLS) == Fresh(
        "assistant_edited"
    )
    other_tools = choose_base([first], chain([SYSTEM, USER, REPLY, RESULT]), "other")
    assert other_tools == Fresh("tools_changed", first)
    compact = prior("c2", [SYSTEM, USER, REPLY, RESULT], edited, seq=3, role="compaction")
    rewritten = [SYSTEM, {"role": "user", "content": "summary"}]
    assert choose_base([first, compact], chain(rewritten), TOOLS) == Fresh("compaction_rewrite")
    assert choose_base([first], chain(rewritten), TOOLS) == Fresh("not_an_extension")
    # Codex keeps the user turns and appends the summary: still a compaction rewrite, not an
    # edited assistant message, although the first call's messages are a prefix.
    kept = [SYSTEM, USER, {"role": "user", "content": "summary"}]
    assert choose_base([first, compact], chain(kept), TOOLS) == Fresh("compaction_rewrite")


def test_stitched_prompt_is_prompt_completion_trailer_suffix() -> None:
    prompt = [1, 2, 3, 7]  # previous prompt, ends with the generation prompt
    completion = [40, 41, EOT]  # sampled (non-canonical split of the assistant text)
    # the template's render of history + reply: canonical split [44] of the same text, EOT, NL
    with_reply = [1, 2, 3, 7, 44, EOT, NL]
    full = [*with_reply, 6, 60, 61, EOT, NL, 7]  # + tool turn + generation prompt
    stitched = stitch_prompt(prompt, completion, EOT, with_reply, full)
    assert isinstance(stitched, Stitched)
    assert stitched.prompt_ids == [1, 2, 3, 7, 40, 41, EOT, NL, 6, 60, 61, EOT, NL, 7]
    assert stitched.prompt_ids[: stitched.base_len] == prompt + completion
    assert stitched.trailer == [NL]
    assert stitched.suffix == [6, 60, 61, EOT, NL, 7]


def test_truncated_completion_gets_the_end_of_turn() -> None:
    stitched = stitch_prompt([1, 7], [40, 41], EOT, [1, 7, 44, EOT, NL], [1, 7, 44, EOT, NL, 8])
    assert isinstance(stitched, Stitched)
    assert stitched.prompt_ids == [1, 7, 40, 41, EOT, NL, 8]


def test_template_that_rewrites_history_falls_back() -> None:
    # e.g. a template that drops reasoning from earlier assistant turns once a turn follows
    with_reply = [1, 7, 44, 45, EOT, NL]
    full = [1, 7, 45, EOT, NL, 6, 7]
    assert stitch_prompt([1, 7], [44, 45, EOT], EOT, with_reply, full) == Fresh(
        "template_not_prefix_stable"
    )
    assert stitch_prompt([1, 7], [44], EOT, [1, 7, 44], [1, 7, 44, 8]) == Fresh(
        "template_not_prefix_stable"
    )


def test_one_render_cuts_where_the_head_render_would() -> None:
    """Where the template renders the reply as it does last, the full render alone gives the
    two renders' ids: the reply's rendering ends at the first end-of-turn after the base's own
    render (its prompt, generation prompt included); the trailer is reported in the suffix."""
    prompt = [1, 2, 3, 7]
    completion = [40, 41, EOT]
    with_reply = [1, 2, 3, 7, 44, EOT, NL]
    full = [*with_reply, 6, 60, 61, EOT, NL, 7]
    two = stitch_prompt(prompt, completion, EOT, with_reply, full)
    one = stitch_on_render(prompt, completion, EOT, len(prompt), full)
    assert isinstance(two, Stitched) and one is not None
    assert one.prompt_ids == two.prompt_ids and one.base_len == two.base_len
    assert one.trailer == [] and one.suffix == [NL, 6, 60, 61, EOT, NL, 7]
    truncated = stitch_on_render([1, 7], [40, 41], EOT, 2, [1, 7, 44, EOT, NL, 8])
    assert truncated is not None and truncated.prompt_ids == [1, 7, 40, 41, EOT, NL, 8]
    assert stitch_on_render([1, 7], [40], EOT, 2, [1, 7, 44, NL, 8]) is None  # no end of turn


def test_one_render_is_wrong_where_the_template_rewrites_the_reply() -> None:
    """A template that renders the last assistant message otherwise than an earlier one (an
    empty reasoning block while it is last): the one-render cut differs from the two renders'.
    Only the head render shows it, so the proxy learns per head shape, never assumes."""
    with_reply = [1, 7, 30, 31, 44, EOT, NL]  # last: "<think></think>" + reply
    full = [1, 7, 44, EOT, NL, 6, 7]  # not last: the reply alone
    assert stitch_prompt([1, 7], [44, EOT], EOT, with_reply, full) == Fresh(
        "template_not_prefix_stable"
    )
    one = stitch_on_render([1, 7], [44, EOT], EOT, 2, full)
    assert one is not None  # (a cut is found: it is the learning that keeps it unused)


def test_own_render_is_known_by_length_and_digest() -> None:
    ids = [1, 2, 3, 2**31 - 1]
    mark = OwnRender.of(ids)
    assert mark == OwnRender(4, render_digest(ids)) and len(mark.digest) == 32
    assert OwnRender.of([1, 2, 3, 2**31 - 2]) != mark and OwnRender.of(ids[:3]) != mark
    # the stored format: SHA-256 of the compact JSON array, 32 hex digits
    assert render_digest([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()[:32]


def test_head_shape_holds_what_reaches_the_template() -> None:
    reply = {"role": "assistant", "content": "ok"}
    body = {"model": "m", "messages": [USER, reply, RESULT], "tools": [{"type": "function"}]}

    def shape(**changes: Any) -> str | None:
        return head_shape(body | changes, 1, "<|im_end|>")

    plain = shape()
    assert plain is not None
    # sampling and transport options do not reach the template
    assert shape(temperature=0.3, seed=4, stream=True, max_tokens=9, logprobs=True) == plain
    others = [
        shape(model="other"),
        shape(tools=[]),
        shape(chat_template_kwargs={"enable_thinking": False}),
        shape(some_new_field=1),  # not known to stay out of the template: in the shape
        shape(messages=[USER, reply, USER]),  # a user turn after the reply, not a tool result
        shape(messages=[USER, reply | {"reasoning_content": "hm"}, RESULT]),
        shape(messages=[USER, reply | {"tool_calls": [{"id": "1"}]}, RESULT]),
        shape(messages=[USER, {"role": "assistant", "content": "<think>a</think>b"}, RESULT]),
    ]
    assert plain not in others and len(set(others)) == len(others)
    # templates tell an absent field from an empty one, one tool call from two, a user turn
    # from a tool result wrapped in a tag (Qwen3), one appended message from two
    call = {"id": "1", "function": {"name": "f", "arguments": "{}"}}
    finer = [
        shape(messages=[USER, reply | {"tool_calls": []}, RESULT]),
        shape(messages=[USER, reply | {"tool_calls": None}, RESULT]),
        shape(messages=[USER, reply | {"reasoning_content": ""}, RESULT]),
        shape(messages=[USER, reply | {"tool_calls": [call]}, RESULT]),
        shape(messages=[USER, reply | {"tool_calls": [call, call]}, RESULT]),
        shape(messages=[USER, reply, {"role": "user", "content": "<tool_response>x"}]),
        shape(messages=[USER, reply, {"role": "user", "content": "x"}]),
        shape(messages=[USER, reply, RESULT, RESULT]),
    ]
    assert plain not in finer and len(set(finer)) == len(finer)
    # the end-of-turn token in the reply's text, wherever it is: no shape (two renders)
    eot = "<|im_end|>"
    for text in (f"a {eot} b", "<think>" + eot):
        assert shape(messages=[USER, {"role": "assistant", "content": text}, RESULT]) is None
    escaped = '{"code": "\\u003c|im_end|>"}'  # (a JSON escape in tool-call arguments)
    with_call = reply | {"tool_calls": [{"function": {"name": "f", "arguments": escaped}}]}
    assert shape(messages=[USER, with_call, RESULT]) is None
    sentence = "<｜end▁of▁sentence｜>"  # (DeepSeek's: not ASCII)
    assert (
        head_shape(body | {"messages": [USER, reply | {"content": sentence}, RESULT]}, 1, sentence)
        is None
    )
    assert head_shape(body, 1, sentence) is not None


def test_streamed_reply_equals_whole_reply() -> None:
    acc = ReplyAccumulator()
    call = {"index": 0, "id": "a", "type": "function", "function": {"name": "look"}}
    acc.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    acc.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    part = {"index": 0, "function": {"arguments": '{"shelf": 1}'}}
    acc.feed({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
    acc.feed({"choices": [], "usage": {"prompt_tokens": 3}})
    whole = reply_message({"message": {"role": "assistant", "content": None, "tool_calls": [CALL]}})
    assert chain([acc.message(0)]) == chain([whole]) == chain([REPLY])


@st.composite
def _history(draw: st.DrawFn) -> tuple[list[PriorCall], list[str], str]:
    """Recorded calls over a small alphabet of messages, and a request's hash chain and tools."""
    alphabet = [{"role": "user", "content": t} for t in "abc"] + [
        {"role": "assistant", "content": t} for t in "xy"
    ]
    messages = st.lists(st.sampled_from(alphabet), min_size=1, max_size=5)
    priors = []
    turns = []
    for seq, (sent, reply, role, tools) in enumerate(
        draw(
            st.lists(
                st.tuples(
                    messages,
                    st.sampled_from(alphabet[3:]),
                    st.sampled_from(["policy", "compaction"]),
                    st.sampled_from(["t1", "t2"]),
                ),
                max_size=8,
            )
        ),
        start=1,
    ):
        hashes = chain([*sent, reply])
        turns.append([*sent, reply])
        priors.append(PriorCall(f"c{seq}", seq, role, len(sent), hashes[-2], hashes[-1], tools))
    sent = draw(messages)
    if turns and draw(st.booleans()):  # continue (or edit) one of the recorded turns
        base = list(draw(st.sampled_from(turns)))
        if draw(st.booleans()):
            base[-1] = draw(st.sampled_from(alphabet[3:]))
        sent = base + sent
    return priors, chain(sent), draw(st.sampled_from(["t1", "t2"]))


@settings(max_examples=300, deadline=None)
@given(_history())
def test_indexed_priors_choose_as_the_plain_scan(
    case: tuple[list[PriorCall], list[str], str],
) -> None:
    priors, hashes, tools = case
    index = Priors()
    for prior in priors:
        index.add(prior)
    assert index.choose(hashes, tools) == choose_base(priors, hashes, tools)
