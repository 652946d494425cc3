"""The Messages and Responses routes in-process (``ASGITransport``; the fake engine).

Each translated request is one captured chat call: the engine saw the translated chat body,
the store holds its tokens, the harness gets the API's own objects and events, and every error
on a Messages route has Anthropic's shape. Attribution comes from Claude Code's and Codex's own
headers; roles from the default rules.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_proxy.translate import messages as tm
from capture_proxy.translate import responses as tr
from tests.fixtures import fake_engine
from tests.support.inproc import passthrough_settings, served

SEEN: list[dict[str, Any]] = []


async def engine(request: httpx.Request) -> httpx.Response:
    """The fake engine, plus ``/tokenize`` (count_tokens) and a record of what it was sent."""
    body = json.loads(request.content) if request.content else {}
    SEEN.append({"path": request.url.path, "body": body})
    if request.url.path == "/tokenize":
        ids = fake_engine.prompt_ids(body)
        return httpx.Response(200, json={"count": len(ids), "tokens": ids})
    return await fake_engine.handler(request)


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    SEEN.clear()
    async with served(passthrough_settings(tmp_path), engine) as (http, _app):
        yield http


async def episode(client: httpx.AsyncClient) -> str:
    reply = await client.post("/episodes", json={"group_id": "g"})
    assert reply.status_code == 201
    return str(reply.json()["episode_id"])


def claude(model: str = "fake", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count."}]}],
        **extra,
    }


def codex(model: str = "fake", **extra: Any) -> dict[str, Any]:
    return {"model": model, "instructions": "Be Codex.", "input": "Count.", **extra}


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def bundle_calls(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = (await client.get(f"/episodes/{episode_id}/bundle")).json()[
        "calls"
    ]
    return calls


async def test_messages_whole_answer_is_one_captured_chat_call(client: httpx.AsyncClient) -> None:
    ep = await episode(client)
    body = claude()
    reply = await client.post(f"/episodes/{ep}/v1/messages?beta=true", json=body)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "text" and message["stop_reason"] == "end_turn"
    assert message["usage"]["output_tokens"] == fake_engine.COMPLETION_LEN
    [sent] = [s["body"] for s in SEEN if s["path"] == "/v1/chat/completions"]
    assert sent["messages"] == tm.to_chat_request(body)["messages"]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    [call] = await bundle_calls(client, ep)
    assert call["call_id"] == reply.headers["x-capture-call-id"] and call["status"] == "completed"
    assert call["prompt_token_ids"] == fake_engine.prompt_ids(sent)
    assert len(call["completion_token_ids"]) == len(call["completion_logprobs"]) == 4


async def test_messages_stream_by_header_ends_after_commit(client: httpx.AsyncClient) -> None:
    ep = await episode(client)
    reply = await client.post(
        "/v1/messages", json=claude(stream=True), headers={"X-Episode-Id": ep}
    )
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    names = [name for name, _ in events(reply.text)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events(reply.text) if n == "content_block_delta")
    [call] = await bundle_calls(client, ep)
    assert call["status"] == "completed"
    [info] = (await client.get(f"/episodes/{ep}/calls")).json()
    assert info["stream"] is True
    assert len(text) == len(call["completion_token_ids"])  # one character per fake token


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "kind"),
    [
        ("/episodes/nope/v1/messages", claude(), {}, 404, "not_found_error"),
        ("/v1/messages", claude(), {}, 400, "invalid_request_error"),  # no X-Episode-Id
        ("/episodes/{ep}/v1/messages", {"model": "fake"}, {}, 400, "invalid_request_error"),
        ("/episodes/{ep}/v1/messages", claude("fake-error-500"), {}, 500, "api_error"),
        ("/episodes/nope/v1/messages/count_tokens", claude(), {}, 404, "not_found_error"),
    ],
)
async def test_messages_errors_have_the_anthropic_shape(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    status: int,
    kind: str,
) -> None:
    ep = await episode(client)
    reply = await client.post(path.format(ep=ep), json=body, headers=headers)
    assert reply.status_code == status
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    if body.get("model") == "fake-error-500":
        [call] = await bundle_calls(client, ep)
        assert call["status"] == "failed"  # recorded, never lost


async def test_messages_bad_json_has_the_anthropic_shape(client: httpx.AsyncClient) -> None:
    ep = await episode(client)
    reply = await client.post(f"/episodes/{ep}/v1/messages", content=b"{not json")
    assert reply.status_code == 400 and reply.json()["type"] == "error"


async def test_count_tokens_uses_the_engines_template_and_tokenizer(
    client: httpx.AsyncClient,
) -> None:
    ep = await episode(client)
    body = claude()
    reply = await client.post(f"/episodes/{ep}/v1/messages/count_tokens", json=body)
    assert reply.status_code == 200, reply.text
    [sent] = [s["body"] for s in SEEN if s["path"] == "/tokenize"]
    assert sent["messages"] == tm.to_chat_request(body)["messages"]
    assert reply.json() == {"input_tokens": len(fake_engine.prompt_ids(sent))}
    assert await bundle_calls(client, ep) == []  # counting is not a model call


async def test_responses_whole_and_streamed(client: httpx.AsyncClient) -> None:
    ep = await episode(client)
    whole = await client.post(f"/episodes/{ep}/v1/responses", json=codex())
    assert whole.status_code == 200, whole.text
    response = whole.json()
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["output"][0]["content"][0]["type"] == "output_text"
    streamed = await client.post(
        "/v1/responses", json=codex(stream=True), headers={"X-Episode-Id": ep}
    )
    names = [n for n, _ in events(streamed.text)]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    final = events(streamed.text)[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["type"] == "message"
    calls = await bundle_calls(client, ep)
    assert [c["status"] for c in calls] == ["completed", "completed"]
    sent = [s["body"] for s in SEEN if s["path"] == "/v1/chat/completions"]
    assert sent[0]["messages"] == tr.to_chat_request(codex())["messages"]


async def test_responses_errors_have_the_openai_shape(client: httpx.AsyncClient) -> None:
    reply = await client.post("/episodes/nope/v1/responses", json=codex())
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    ep = await episode(client)
    reply = await client.post(
        f"/episodes/{ep}/v1/responses", json=codex(previous_response_id="resp_1")
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "previous_response_id"


async def test_claude_code_and_codex_headers_attribute_agents_and_roles(
    client: httpx.AsyncClient,
) -> None:
    ep = await episode(client)
    url = f"/episodes/{ep}/v1/messages"
    session = {"X-Claude-Code-Session-Id": "S"}
    await client.post(url, json=claude(), headers=session)
    await client.post(url, json=claude(), headers={**session, "x-claude-code-agent-id": "A"})
    await client.post(
        url,
        json=claude(),
        headers={**session, "x-claude-code-agent-id": "B", "x-claude-code-parent-agent-id": "A"},
    )
    await client.post(
        url, json=claude(), headers={**session, "x-claude-code-request-class": "compaction"}
    )
    turn = {"session_id": "S2", "thread_id": "T1", "agent_name": "/root", "request_kind": "turn"}
    meta = {"x-codex-turn-metadata": json.dumps(turn)}
    await client.post(f"/episodes/{ep}/v1/responses", json=codex(), headers=meta)
    compact = {"x-codex-turn-metadata": json.dumps(turn | {"request_kind": "compaction"})}
    await client.post(f"/episodes/{ep}/v1/responses", json=codex(), headers=compact)
    child = {
        "x-codex-turn-metadata": json.dumps(turn | {"thread_id": "T2"}),
        "x-codex-parent-thread-id": "T1",
    }
    await client.post(f"/episodes/{ep}/v1/responses", json=codex(), headers=child)
    calls = (await client.get(f"/episodes/{ep}/calls")).json()
    assert [(c["agent_id"], c["parent_agent_id"], c["role"]) for c in calls] == [
        ("S", None, "policy"),
        ("A", "S", "policy"),  # a subagent of the main thread: the session is its parent
        ("B", "A", "policy"),
        ("S", None, "compaction"),
        ("T1", None, "policy"),
        ("T1", None, "compaction"),
        ("T2", "T1", "policy"),
    ]
