"""The body sent to the engine: the capture fields, a stream interval and overrides added, the
harness's body kept."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from capture_proxy.capture import prepare_upstream_body
from capture_proxy.settings import UpstreamSettings


def test_capture_fields_and_overrides_are_added_and_the_harness_body_is_kept() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "logprobs": False,
    }
    before = copy.deepcopy(body)
    settings = UpstreamSettings(
        url="http://engine", overrides={"extra": {"k": [1]}}, served_model="served"
    )
    upstream, wants = prepare_upstream_body("chat", body, settings)
    assert body == before  # the harness's body as it came
    assert upstream["return_token_ids"] is True and upstream["logprobs"] is True
    assert upstream["model"] == "served" and upstream["messages"] == before["messages"]
    assert not wants.logprobs and not wants.token_ids
    upstream["extra"]["k"].append(2)  # the overrides are the request's own copy
    assert settings.overrides == {"extra": {"k": [1]}}


def test_completions_keep_a_larger_logprobs_request() -> None:
    upstream, wants = prepare_upstream_body(
        "completions", {"prompt": "x", "logprobs": 3}, UpstreamSettings(url="http://engine")
    )
    assert upstream["logprobs"] == 3 and wants.logprobs


def test_stream_interval_is_asked_for_streamed_requests_only() -> None:
    settings = UpstreamSettings(url="http://engine", stream_interval=8)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    streamed, _ = prepare_upstream_body("chat", {**chat, "stream": True}, settings)
    assert streamed["stream_interval"] == 8
    whole, _ = prepare_upstream_body("chat", {**chat, "stream": False}, settings)
    assert "stream_interval" not in whole  # (the engine ignores it there; nothing to send)
    own, _ = prepare_upstream_body("chat", {**chat, "stream": True, "stream_interval": 2}, settings)
    assert own["stream_interval"] == 2  # the harness's own choice stands
    unset, _ = prepare_upstream_body(
        "chat", {**chat, "stream": True}, UpstreamSettings(url="http://engine")
    )
    assert "stream_interval" not in unset


def test_a_stream_interval_below_one_is_refused_by_the_settings() -> None:
    with pytest.raises(ValidationError, match="stream_interval"):
        UpstreamSettings(url="http://engine", stream_interval=0)
