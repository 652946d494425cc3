"""A fault of the proxy's own while a call runs: the call is recorded ``failed`` with the fault
(not ``cancelled`` as if the client had left), and the harness gets a server error in the API's
shape — the whole answer's status, or the stream's last event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture_proxy import proxy
from capture_proxy.capture import StreamCapture
from tests.support.inproc import passthrough_settings, served

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _boom(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("boom")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_fault_of_the_proxy_fails_the_call_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    if stream:
        monkeypatch.setattr(StreamCapture, "generations", _boom)
    else:
        monkeypatch.setattr(proxy, "generations_from_response", _boom)
    async with served(passthrough_settings(tmp_path)) as (http, _app):
        episode = (await http.post("/episodes", json={"group_id": "g"})).json()["episode_id"]
        url = f"/episodes/{episode}/v1/chat/completions"
        reply = await http.post(url, json={**CHAT, "stream": stream})
        if stream:
            assert reply.status_code == 200
            events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in events
            body = json.loads(events[-1])
        else:
            assert reply.status_code == 500
            body = reply.json()
        assert body["error"]["message"] == "internal error"
        [call] = (await http.get(f"/episodes/{episode}/calls")).json()
        assert call["status"] == "failed"
        assert call["error"] == "internal error: RuntimeError: boom"
