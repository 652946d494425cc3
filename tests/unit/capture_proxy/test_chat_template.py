"""The proxy's render of the model's chat template (capture_proxy/chat_template.py): vLLM's
normalisation of the messages, transformers' template environment, and the ids after a reply.

The model is the dev kit's tiny one (its tokenizer and Qwen-style template); that these renders
give the real engine's ids is checked against vLLM in the integration tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from capture_devkit.tiny_model import build_tiny_model
from capture_proxy.chat_template import ChatTemplate, _conversation, _tools
from capture_proxy.errors import InvalidSettings

EOT = "<|im_end|>"
BASH = {
    "type": "function",
    "function": {
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        "name": "bash",
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def template(model_dir: Path) -> ChatTemplate:
    return ChatTemplate.load(model_dir, EOT)


def _render(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any = None) -> str:
    conversation = _conversation(messages)
    assert conversation is not None
    return template.render(conversation, _tools(tools), generation_prompt=True)


def test_text_parts_are_joined_by_newlines_and_none_is_empty(template: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b"]
    text = _render(template, [{"role": "user", "content": parts}, {"role": "user"}])
    assert text == (
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_call_arguments_reach_the_template_as_objects(template: ChatTemplate) -> None:
    def call(arguments: str) -> dict[str, Any]:
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    reply = {
        "role": "assistant",
        "content": None,
        # (keys in their order, non-ASCII unescaped: transformers' tojson; not JSON: {})
        "tool_calls": [call('{"b": 1, "a": "é"}'), call("not json"), call(""), call("[1]")],
    }
    text = _render(template, [reply])
    assert '"arguments": {"b": 1, "a": "é"}}' in text
    assert text.count('"arguments": {}}') == 3
    empty = _conversation([{"role": "assistant", "content": "x", "tool_calls": []}])
    assert empty == [{"role": "assistant", "content": "x"}]  # (an empty list is dropped)


def test_tools_are_written_as_vllms_request_model_dumps_them(template: ChatTemplate) -> None:
    strict = {"type": "function", "function": {"name": "g", "strict": True}}
    text = _render(template, [{"role": "user", "content": "u"}], [BASH, strict])
    lines = [json.loads(line) for line in text.split("\n") if line.startswith('{"type"')]
    assert [list(tool["function"]) for tool in lines] == [
        ["name", "description", "parameters"],
        ["name", "description", "parameters", "strict"],
    ]
    assert lines[0]["function"]["description"] is None


def test_the_ids_after_a_reply_are_the_whole_texts_after_its_end_of_turn(
    template: ChatTemplate,
) -> None:
    """Encoding only the text after the reply's end-of-turn token gives the ids the whole text's
    encoding has there (the tokenizer splits on special tokens first)."""
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "count the files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "ls | wc"}'}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "  3 files\n"},
        {"role": "user", "content": "and now?"},
    ]
    body = {"model": "m", "messages": messages, "tools": [BASH], "temperature": 1.0}
    ids = template.continuation_ids(body, 2)
    conversation = _conversation(messages)
    assert conversation is not None
    full = template.render(conversation, _tools([BASH]), generation_prompt=True)
    whole: list[int] = template._tokenizer.encode(full, add_special_tokens=False).ids
    head = template.render(conversation[:3], _tools([BASH]), generation_prompt=False)
    reply_end = len(template._tokenizer.encode(head, add_special_tokens=False).ids) - 1
    while whole[reply_end] != template.end_of_turn_id:
        reply_end -= 1
    assert ids == whole[reply_end + 1 :] and len(ids) > 10


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "developer", "content": "d"}]},
        {"messages": [{"role": "user", "content": "u", "reasoning": "r"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "t", "x": 1}]}]},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template": "{{ messages }}"},
        {"continue_final_message": True},
        {"add_generation_prompt": False},
        {"tools": []},
        {"tools": [{"type": "function", "function": {"name": "f", "other": 1}}]},
        {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
    ],
)
def test_requests_this_does_not_replicate_are_left_to_the_engine(
    template: ChatTemplate, change: dict[str, Any]
) -> None:
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ]
    body = {"model": "m", "messages": messages}
    assert template.continuation_ids(body, 1) is not None
    changed = body | change
    if "messages" in change:
        changed["messages"] = messages + change["messages"]
    assert template.continuation_ids(changed, 1) is None


def test_a_template_that_refuses_a_request_leaves_it_to_the_engine(model_dir: Path) -> None:
    source = "{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}ok<|im_end|>"
    refusing = ChatTemplate(source, ChatTemplate.load(model_dir, EOT)._tokenizer, {}, EOT)
    two = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert refusing.continuation_ids({"messages": two}, 1) == []
    assert refusing.continuation_ids({"messages": [*two, {"role": "user"}]}, 1) is None


def test_transformers_generation_blocks_render_their_body(model_dir: Path) -> None:
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor"
    source += " %}"
    tracked = ChatTemplate(source, ChatTemplate.load(model_dir, EOT)._tokenizer, {}, EOT)
    assert tracked.render([{"role": "user", "content": "x"}], None, generation_prompt=True) == "[x]"


def test_the_template_file_wins_and_special_tokens_are_variables(
    model_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}|{{ bos_token is defined }}")
    loaded = ChatTemplate.load(tmp_path, EOT)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    expected = f"{config['eos_token']}|False"  # (bos_token null: not defined, as transformers)
    assert loaded.render([], None, generation_prompt=True) == expected


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("no_directory", "cannot load the tokenizer in"),
        ("no_template", "holds no chat template"),
        ("no_end_of_turn", "the tokenizer has no token '<|nowhere|>'"),
    ],
)
def test_a_directory_it_cannot_use_is_a_clear_settings_error(
    model_dir: Path, tmp_path: Path, broken: str, message: str
) -> None:
    eot = "<|nowhere|>" if broken == "no_end_of_turn" else EOT
    if broken != "no_directory":
        (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        if broken == "no_template":
            config.pop("chat_template")
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidSettings, match=re.escape(message)):
        ChatTemplate.load(tmp_path / "model" if broken == "no_directory" else tmp_path, eot)
