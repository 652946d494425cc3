"""Who made a call and what kind of call it is (DESIGN §4).

Agent, in this order: ``X-Agent-Id``/``X-Parent-Agent-Id``; OpenCode's ``x-session-id``/
``x-parent-session-id``; a configured body field. Role: ``X-Call-Role``, else the first matching
configured rule, else ``policy``. Harness-only body fields are removed before forwarding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from capture_proxy.errors import BadRequest
from capture_proxy.settings import AttributionSettings, Role

ROLES: tuple[str, ...] = get_args(Role)


@dataclass(frozen=True, slots=True)
class Attribution:
    agent_id: str | None
    parent_agent_id: str | None
    role: str


def _first_system_text(body: dict[str, Any]) -> str:
    for message in body.get("messages") or []:
        if not isinstance(message, dict) or message.get("role") not in {"system", "developer"}:
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return ""
    return ""


def _role(headers: Mapping[str, str], body: dict[str, Any], settings: AttributionSettings) -> str:
    explicit = headers.get("x-call-role")
    if explicit is not None:
        if explicit not in ROLES:
            raise BadRequest(
                f"X-Call-Role must be one of {', '.join(ROLES)}, not {explicit!r}",
                param="X-Call-Role",
            )
        return explicit
    system = _first_system_text(body)
    for rule in settings.role_rules:
        if rule.no_tools and body.get("tools"):
            continue
        if system.startswith(rule.system_prefix):
            return rule.role
    return "policy"


def attribute(
    headers: Mapping[str, str], body: dict[str, Any], settings: AttributionSettings
) -> tuple[Attribution, dict[str, Any]]:
    """The call's attribution and the body to forward (harness-only fields removed)."""
    agent = headers.get("x-agent-id") or headers.get("x-session-id")
    parent = headers.get("x-parent-agent-id") or headers.get("x-parent-session-id")
    forwarded = dict(body)
    if settings.agent_body_field and settings.agent_body_field in forwarded:
        value = forwarded.pop(settings.agent_body_field)
        if agent is None and isinstance(value, str | int):
            agent = str(value)
    for name in settings.strip_body_fields:
        forwarded.pop(name, None)
    return Attribution(agent, parent, _role(headers, body, settings)), forwarded
