"""The served model's chat template, rendered in the proxy: a stitched call without the engine's
render requests.

A stitched call needs the template's ids after the continued reply: the trailer after its
end-of-turn token, the appended messages and the generation prompt (:mod:`capture_proxy.stitch`).
The engine's render route gives them, at the price of one or two requests that wait, under load,
behind the engine's other requests (15–22 ms at c=8 on the 2-core dev machine). This module
renders them here from the model's own files, as vLLM 0.32 renders a text-only chat request:

- vLLM's normalisation of the messages (``vllm/renderers/chat_utils.py``): text parts joined
  with newlines (empty ones dropped), ``None`` content as ``""``, tool-call arguments parsed to
  objects (``{}`` when empty, not JSON or not an object), an empty ``tool_calls`` dropped,
  ``name`` and ``tool_call_id`` kept; the tools as vLLM's request model writes them (``type``,
  then ``function`` with ``name``, ``description`` and ``parameters``, ``strict`` when set);
- transformers' template environment: a sandbox with ``trim_blocks``, ``lstrip_blocks`` and loop
  controls, ``{% generation %}`` blocks rendered as their body, ``tojson`` without sorted keys or
  ASCII escapes, ``raise_exception`` and ``strftime_now``; the tokenizer's special tokens as
  variables;
- the text after the reply's end-of-turn token encoded alone: it follows a special token, which
  the tokenizer splits the text on before anything else, so its ids are the whole text's after
  that token. Encoding only the appended text keeps the cost in the size of the new turn.

Anything else — content that is not text, a ``developer`` message, reasoning fields, the
request's own template or template arguments, a prefilled reply — is not rendered here
(:meth:`ChatTemplate.continuation_ids` answers ``None``) and the engine renders it. That this
render gives the engine's ids is learned per head shape and rechecked, never assumed
(:class:`~capture_proxy.render_shapes.LocalShapes`): a server ``--chat-template``, another
tokenizer or a template that reads more than this replicates shows there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capture_proxy.errors import InvalidSettings

if TYPE_CHECKING:
    import jinja2
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rendering in the proxy needs jinja2 and tokenizers: pip install 'capture-proxy[render]'"
)
_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
#: Request fields that change the render beyond the messages and the tools (rendered by the
#: engine when present).
_ENGINE_RENDERS = (
    "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "mm_processor_kwargs",
)  # fmt: skip
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


class ChatTemplate:
    """A model's chat template and tokenizer, loaded from its directory (:meth:`load`)."""

    def __init__(
        self, template: str, tokenizer: Tokenizer, special: dict[str, str], end_of_turn: str
    ) -> None:
        eot_id = tokenizer.token_to_id(end_of_turn)
        if eot_id is None:
            raise InvalidSettings(f"the tokenizer has no token {end_of_turn!r} (end_of_turn_token)")
        self.end_of_turn = end_of_turn
        self.end_of_turn_id: int = eot_id
        self._tokenizer = tokenizer
        self._special = special
        self._template = _environment().from_string(template)

    @classmethod
    def load(cls, directory: Path, end_of_turn: str) -> ChatTemplate:
        """From ``tokenizer.json`` and the template (``chat_template.jinja``, else
        ``tokenizer_config.json``'s ``chat_template``); a clear error for anything missing."""
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - the test environment has it
            raise InvalidSettings(INSTALL_HINT) from exc
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # (a missing file, bad JSON, the tokenizers library's own)
            raise InvalidSettings(f"cannot load the tokenizer in {directory}: {exc}") from exc
        template_file = directory / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _named_template(config.get("chat_template"))
        )
        if not template:
            raise InvalidSettings(f"{directory} holds no chat template (a single, default one)")
        special = {key: text for key in _SPECIAL_KEYS if (text := _token(config.get(key)))}
        return cls(template, tokenizer, special, end_of_turn)

    def continuation_ids(self, body: dict[str, Any], reply_index: int) -> list[int] | None:
        """The ids after the end-of-turn token that ends ``messages[reply_index]`` (the continued
        reply) in the render of the whole request: the template's trailer after it, the appended
        messages and the generation prompt. None: not rendered here (the engine renders)."""
        if any(key in body for key in _ENGINE_RENDERS) or body.get("tools") == []:
            return None
        if body.get("continue_final_message") or body.get("add_generation_prompt", True) is False:
            return None
        conversation = _conversation(body.get("messages"))
        if conversation is None or not _plain_tools(body.get("tools")):
            return None
        tools = _tools(body.get("tools"))
        try:
            head = self.render(conversation[: reply_index + 1], tools, generation_prompt=False)
            full = self.render(conversation, tools, generation_prompt=True)
        except Exception as exc:  # a template's own refusal, or one this does not replicate
            log.debug("the chat template did not render here (%s): the engine renders", exc)
            return None
        cut = head.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(head):
            return None
        rest = full[cut + len(self.end_of_turn) :]
        ids: list[int] = self._tokenizer.encode(rest, add_special_tokens=False).ids
        return ids

    def render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
        generation_prompt: bool,
    ) -> str:  # fmt: skip
        """The template's text for already normalised messages (:func:`_conversation`)."""
        return self._template.render(
            messages=list(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **self._special,
        )


def _conversation(messages: Any) -> list[dict[str, Any]] | None:
    """The messages as vLLM hands them to the template (text only), or None."""
    if not isinstance(messages, list):
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict) or not _MESSAGE_KEYS.issuperset(message):
            return None
        role = message.get("role")
        text = _text(message.get("content"))
        if role not in _ROLES or text is None:
            return None
        item: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _tool_calls(message["tool_calls"])
            if calls is None:
                return None
            if calls:
                item["tool_calls"] = calls
        if role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        out.append(item)
    return out


def _text(content: Any) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif _text_part(part):
            texts.append(part["text"])
        else:
            return None
    return "\n".join(text for text in texts if text)


def _text_part(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and part.get("type") == "text"
        and set(part) <= {"type", "text"}
        and isinstance(part.get("text"), str)
    )


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            return None
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        out.append(call | {"function": function | {"arguments": _object(arguments)}})
    return out


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _plain_tools(tools: Any) -> bool:
    """No tools, or functions with no fields but those vLLM's request model keeps."""
    if tools is None:
        return True
    return isinstance(tools, list) and all(_plain_tool(tool) for tool in tools)


def _plain_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(function, dict)
        and tool.get("type", "function") == "function"
        and set(tool) <= {"type", "function"}
        and set(function) <= {"name", "description", "parameters", "strict"}
        and isinstance(function.get("name"), str)
    )


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The (plain) tools as vLLM's request model dumps them: ``name``, ``description``,
    ``parameters`` in that order, ``strict`` when set."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = tool["function"]
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        out.append({"type": "function", "function": dumped})
    return out


def _named_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        found = named.get("default")
        return found if isinstance(found, str) else None
    return None


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _environment() -> jinja2.Environment:
    """transformers' chat-template environment (``render_jinja_template``'s)."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - the test environment has it
        raise InvalidSettings(INSTALL_HINT) from exc

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}``: its body (transformers tracks its span)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None,
        separators: tuple[str, str] | None = None, sort_keys: bool = False,
    ) -> str:  # fmt: skip
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
