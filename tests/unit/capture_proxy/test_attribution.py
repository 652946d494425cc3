"""Attribution rules (DESIGN §4) and the request-transform hook, without an engine.

Rules are pure functions over headers and body; the links and the hook are checked through the
real app with an ``httpx.MockTransport`` engine that records what it was sent.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from capture_proxy.app import create_app
from capture_proxy.attribution import AgentLinks, Attribution, attribute
from capture_proxy.errors import BadRequest
from capture_proxy.settings import (
    AttributionSettings,
    RoleRule,
    Settings,
    StoreSettings,
    UpstreamSettings,
)
from tests.fixtures.db import sqlite_url

OPENCODE_TITLE = "You are a title generator. You output ONLY a thread title."
OPENCODE_SUMMARY = "You are a context summarization agent. Summarise the conversation."
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def chat(system: str = "You are opencode.", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return {"model": "tiny", "messages": messages, **extra}


def role_of(body: dict[str, Any], headers: dict[str, str] | None = None, **settings: Any) -> str:
    attribution, _ = attribute(headers or {}, body, AttributionSettings(**settings))
    return attribution.role


def test_opencode_defaults_title_is_auxiliary_and_summary_is_compaction() -> None:
    assert role_of(chat(OPENCODE_TITLE)) == "auxiliary"
    assert role_of(chat(OPENCODE_TITLE, tools=TOOLS)) == "policy"  # the rule wants no tools
    assert role_of(chat(OPENCODE_SUMMARY, tools=TOOLS)) == "compaction"
    assert role_of(chat()) == "policy"
    system_parts = [
        {"type": "text", "text": "You are a context "},
        {"type": "text", "text": "summ"},
    ]
    body = chat()
    body["messages"][0]["content"] = [*system_parts, {"type": "text", "text": "arization agent"}]
    assert role_of(body) == "compaction"


def test_explicit_header_wins_and_is_validated() -> None:
    assert role_of(chat(OPENCODE_TITLE), {"x-call-role": "policy"}) == "policy"
    with pytest.raises(BadRequest):
        role_of(chat(), {"x-call-role": "judge"})


@pytest.mark.parametrize(
    ("rule", "body", "headers", "expected"),
    [
        ({"header": "X-Purpose", "header_value": "title"}, chat(), {"x-purpose": "title"}, True),
        ({"header": "X-Purpose", "header_value": "title"}, chat(), {"x-purpose": "x"}, False),
        ({"header": "X-Purpose"}, chat(), {"x-purpose": "anything"}, True),
        ({"body_field": "purpose", "body_value": "summary"}, chat(purpose="summary"), {}, True),
        ({"body_field": "purpose", "body_value": "summary"}, chat(purpose="other"), {}, False),
        ({"body_field": "purpose"}, chat(), {}, False),
        ({"model": "small"}, chat(model="small"), {}, True),
        ({"model": "small"}, chat(), {}, False),
        ({"model": "small", "system_prefix": "You are a title"}, chat(model="small"), {}, False),
    ],
)
def test_rule_matchers(
    rule: dict[str, Any], body: dict[str, Any], headers: dict[str, str], expected: bool
) -> None:
    rules = [RoleRule(role="auxiliary", **rule)]
    assert (role_of(body, headers, role_rules=rules) == "auxiliary") is expected


def test_first_matching_rule_wins_and_rules_need_a_matcher() -> None:
    rules = [RoleRule(role="compaction", model="tiny"), RoleRule(role="auxiliary", model="tiny")]
    assert role_of(chat(), role_rules=rules) == "compaction"
    with pytest.raises(ValidationError):
        RoleRule(role="auxiliary", no_tools=True)


def test_opencode_session_headers_map_to_agent_and_parent() -> None:
    headers = {"x-session-id": "ses_child", "x-parent-session-id": "ses_root"}
    attribution, _ = attribute(headers, chat(), AttributionSettings())
    assert (attribution.agent_id, attribution.parent_agent_id) == ("ses_child", "ses_root")
    explicit = {**headers, "x-agent-id": "worker-a", "x-parent-agent-id": "lead"}
    attribution, _ = attribute(explicit, chat(), AttributionSettings())
    assert (attribution.agent_id, attribution.parent_agent_id) == ("worker-a", "lead")


def test_body_fields_are_read_then_stripped() -> None:
    settings = AttributionSettings(
        agent_body_field="capture_agent",
        parent_agent_body_field="capture_parent",
        role_body_field="capture_role",
        strip_body_fields=["opencode_hint"],
    )
    body = chat(capture_agent="build", capture_parent="lead", capture_role="compaction")
    body["opencode_hint"] = {"x": 1}
    attribution, forwarded = attribute({}, body, settings)
    assert attribution == Attribution("build", "lead", "compaction")
    assert set(forwarded) == {"model", "messages"}
    assert "capture_agent" in body  # the caller's body is not modified
    with pytest.raises(BadRequest):
        attribute({}, chat(capture_role="boss"), settings)


def test_links_fill_missing_parents_and_chain_nested_agents_to_the_root() -> None:
    links = AgentLinks(max_episodes=2)
    root = links.resolve("ep", Attribution("root", None, "policy"))
    assert (root.parent_agent_id, root.episode_id) == (None, "ep")
    links.resolve("ep", Attribution("child", "root", "policy"))
    links.resolve("ep", Attribution("grandchild", "child", "policy"))
    later = links.resolve("ep", Attribution("grandchild", None, "compaction"))
    assert later.parent_agent_id == "child"
    assert links.lineage("ep", "grandchild") == ["grandchild", "child", "root"]
    assert links.lineage("other", "grandchild") == ["grandchild"]  # links are per episode
    links.resolve("ep2", Attribution("a", "b", "policy"))
    links.resolve("ep3", Attribution("a", "b", "policy"))
    assert links.lineage("ep", "grandchild") == ["grandchild"]  # least recent episode evicted


def force_short(body: dict[str, Any], attribution: Attribution) -> dict[str, Any]:
    """A transform hook for the test below (importable by dotted path)."""
    return {**body, "max_tokens": 3, "seen_agent": attribution.agent_id}


def test_transform_hook_by_dotted_path() -> None:
    settings = UpstreamSettings(transform=f"{__name__}.force_short")
    assert settings.transform is force_short


async def test_hook_and_links_through_the_app(tmp_path: Any) -> None:
    sent: list[dict[str, Any]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "model": "tiny",
                "prompt_token_ids": [1, 2],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                        "token_ids": [3],
                        "logprobs": {"content": [{"token": "ok", "logprob": -0.5}]},
                    }
                ],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            },
        )

    settings = Settings(
        store=StoreSettings(url=sqlite_url(tmp_path / "c.db")),
        upstream=UpstreamSettings(
            transform=force_short, overrides={"temperature": 1.0}, served_model="served"
        ),
        attribution=AttributionSettings(strip_body_fields=["options"]),
    )
    app = create_app(settings, upstream_transport=httpx.MockTransport(engine))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client,
    ):
        episode = (await client.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
        url = f"/episodes/{episode}/v1/chat/completions"
        child = {"x-session-id": "ses_b", "x-parent-session-id": "ses_a"}
        assert (await client.post(url, json=chat(options={"a": 1}), headers=child)).is_success
        summary = chat(OPENCODE_SUMMARY)
        reply = await client.post(url, json=summary, headers={"x-session-id": "ses_b"})
        assert reply.is_success
        calls = (await client.get(f"/episodes/{episode}/calls")).json()
    assert [(c["agent_id"], c["parent_agent_id"], c["role"]) for c in calls] == [
        ("ses_b", "ses_a", "policy"),
        ("ses_b", "ses_a", "compaction"),
    ]
    assert sent[0]["max_tokens"] == 3 and sent[0]["seen_agent"] == "ses_b"
    assert sent[0]["temperature"] == 1.0 and sent[0]["model"] == "served"
    assert "options" not in sent[0]
    assert sent[0]["return_token_ids"] is True and sent[0]["logprobs"] is True


CLAUDE_COMPACT = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nSummarise."


def test_claude_code_in_context_compaction_is_a_side_context_of_its_agent() -> None:
    body = chat("You are a Claude agent.", tools=TOOLS)
    body["messages"] += [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": CLAUDE_COMPACT}]},
        {"role": "system", "content": "a trailing reminder"},  # skipped: the last *user* turn
    ]
    headers = {"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A"}
    attribution, _ = attribute(headers, body, AttributionSettings())
    assert attribution == Attribution("A/compaction", "A", "compaction", context_agent_id="A")
    policy, _ = attribute(
        headers, chat("You are a Claude agent.", tools=TOOLS), AttributionSettings()
    )
    assert policy == Attribution("A", "S", "policy")


def test_header_json_field_rule_and_explicit_headers_win() -> None:
    meta = {"x-codex-turn-metadata": json.dumps({"thread_id": "T", "request_kind": "compaction"})}
    assert role_of(chat(), meta) == "compaction"
    assert role_of(chat(), {"x-codex-turn-metadata": "not json"}) == "policy"
    attribution, _ = attribute({**meta, "x-agent-id": "mine"}, chat(), AttributionSettings())
    assert attribution.agent_id == "mine"  # an explicit X-Agent-Id beats the harness's headers
    with pytest.raises(ValidationError):
        RoleRule(role="compaction", agent_suffix="/x")  # a rule needs a matcher
