"""Who made a call and what kind of call it is (DESIGN §4).

Agent, in this order: ``X-Agent-Id``/``X-Parent-Agent-Id``; OpenCode's ``x-session-id``/
``x-parent-session-id``; Claude Code's and Codex's own headers (:func:`harness_agent`);
configured body fields. Role: ``X-Call-Role``, else a configured body field, else the first
matching configured rule (:class:`~capture_proxy.settings.RoleRule`; the defaults recognise
OpenCode's, Claude Code's and Codex's compaction and auxiliary calls), else ``policy``. Body
fields read for attribution (and ``strip_body_fields``) are removed before forwarding.

:class:`AgentLinks` remembers, per episode, each agent's parent as first reported, so a later
call of a subagent that does not repeat its parent still gets it, and every agent's chain can be
walked to its root (OpenCode's nested ``task`` sessions).
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast, get_args

from capture_contracts.vocabulary import ROLES, Role
from capture_proxy.errors import BadRequest
from capture_proxy.settings import AttributionSettings, RoleRule


@dataclass(frozen=True, slots=True)
class Attribution:
    agent_id: str | None
    parent_agent_id: str | None
    role: Role
    episode_id: str | None = None
    #: The agent whose recorded calls this call continues (exact-token continuation), when it
    #: is not ``agent_id``: a side context (``RoleRule.agent_suffix``) continues its parent's.
    context_agent_id: str | None = None


#: Claude Code 2.1 (every request: the session; a subagent's requests add its agent id and its
#: parent's, which is absent for a subagent of the main thread).
CLAUDE_SESSION = "x-claude-code-session-id"
CLAUDE_AGENT = "x-claude-code-agent-id"
CLAUDE_PARENT = "x-claude-code-parent-agent-id"
#: Codex 0.169: a JSON header with session_id, thread_id, agent_name, request_kind, …; a
#: sub-agent's thread names its parent thread in its own header.
CODEX_TURN_METADATA = "x-codex-turn-metadata"
CODEX_PARENT_THREAD = "x-codex-parent-thread-id"


def header_json(headers: Mapping[str, str], name: str) -> dict[str, Any]:
    """A JSON-object header (``{}`` when absent or not an object)."""
    raw = headers.get(name)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def harness_agent(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(agent, parent)`` from Claude Code's or Codex's own headers (no harness change).

    Claude Code: the main thread is its session (``X-Claude-Code-Session-Id``); a subagent
    (``Agent`` tool) sends ``x-claude-code-agent-id`` and, when nested, its parent's
    ``x-claude-code-parent-agent-id`` — a subagent of the main thread gets the session as parent.
    Codex: the agent is the thread (``thread_id`` of ``x-codex-turn-metadata``, else the
    ``thread-id`` header); a sub-agent thread names its parent in ``x-codex-parent-thread-id``
    (or ``parent_thread_id`` in the metadata).
    """
    session = headers.get(CLAUDE_SESSION)
    if session:
        agent = headers.get(CLAUDE_AGENT)
        if agent:
            return agent, headers.get(CLAUDE_PARENT) or session
        return session, None
    metadata = header_json(headers, CODEX_TURN_METADATA)
    thread = _id(metadata.get("thread_id")) or headers.get("thread-id")
    if thread:
        parent = headers.get(CODEX_PARENT_THREAD) or _id(metadata.get("parent_thread_id"))
        return thread, parent if parent != thread else None
    return None, None


def _first_system_text(body: Mapping[str, Any]) -> str:
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


def _last_user_texts(body: Mapping[str, Any]) -> list[str]:
    """The text parts of the last ``user`` message (trailing system reminders skipped)."""
    for message in reversed(body.get("messages") or []):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return [content]
        if isinstance(content, list):
            return [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        return []
    return []


def _checked_role(value: Any, param: str) -> Role:
    if value not in ROLES:
        names = ", ".join(get_args(Role))
        raise BadRequest(f"{param} must be one of {names}, not {value!r}", param=param)
    return cast(Role, value)


def rule_matches(rule: RoleRule, headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
    """Every matcher the rule sets matches this request."""
    if rule.no_tools and body.get("tools"):
        return False
    if rule.model is not None and body.get("model") != rule.model:
        return False
    if rule.header is not None:
        value: Any = headers.get(rule.header.lower())
        if rule.header_field is not None:
            value = header_json(headers, rule.header.lower()).get(rule.header_field)
        if value is None or (rule.header_value is not None and value != rule.header_value):
            return False
    if rule.body_field is not None:
        if rule.body_field not in body:
            return False
        if rule.body_value is not None and body[rule.body_field] != rule.body_value:
            return False
    if rule.last_user_prefix is not None and not any(
        text.startswith(rule.last_user_prefix) for text in _last_user_texts(body)
    ):
        return False
    return rule.system_prefix is None or _first_system_text(body).startswith(rule.system_prefix)


def _role(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    body_role: Any,
    settings: AttributionSettings,
) -> tuple[Role, RoleRule | None]:
    explicit = headers.get("x-call-role")
    if explicit is not None:
        return _checked_role(explicit, "X-Call-Role"), None
    if body_role is not None:
        return _checked_role(body_role, settings.role_body_field or "role"), None
    for rule in settings.role_rules:
        if rule_matches(rule, headers, body):
            return rule.role, rule
    return "policy", None


def _id(value: Any) -> str | None:
    return str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None


MAX_AGENT_ID_CHARS = 200  # the store's column


def _checked_id(value: str | None, name: str) -> str | None:
    """An agent id fit for the store (PostgreSQL refuses NUL and over-long values): else 400."""
    if value is not None and (len(value) > MAX_AGENT_ID_CHARS or "\x00" in value):
        raise BadRequest(
            f"{name} must be at most {MAX_AGENT_ID_CHARS} characters, without NUL", param=name
        )
    return value


def attribute(
    headers: Mapping[str, str], body: dict[str, Any], settings: AttributionSettings
) -> tuple[Attribution, dict[str, Any]]:
    """The call's attribution and the body to forward (harness-only fields removed).

    ``headers`` must look names up case-insensitively (Starlette's do) or be lower-case.
    """
    forwarded = dict(body)
    read: dict[str, Any] = {}
    fields = {
        "agent": settings.agent_body_field,
        "parent": settings.parent_agent_body_field,
        "role": settings.role_body_field,
    }
    for key, name in fields.items():
        if name and name in forwarded:
            read[key] = forwarded.pop(name)
    for name in settings.strip_body_fields:
        forwarded.pop(name, None)
    agent = headers.get("x-agent-id") or headers.get("x-session-id")
    parent = headers.get("x-parent-agent-id") or headers.get("x-parent-session-id")
    if agent is None:
        agent, harness_parent = harness_agent(headers)
        parent = parent or harness_parent
    agent = _checked_id(agent or _id(read.get("agent")), "X-Agent-Id")
    parent = _checked_id(parent or _id(read.get("parent")), "X-Parent-Agent-Id")
    role, rule = _role(headers, forwarded, read.get("role"), settings)
    if rule is not None and rule.agent_suffix and agent is not None:
        # A side context on the agent's own tokens (Claude Code's compaction appends its
        # instruction to the agent's context): its own agent, the agent as its parent, so
        # reconstruction sees a shared-prefix fork, not the agent going back (DESIGN §5 3c).
        side = f"{agent}{rule.agent_suffix}"
        return Attribution(side, agent, role, context_agent_id=agent), forwarded
    return Attribution(agent, parent, role), forwarded


class AgentLinks:
    """Agent → parent links per episode, as first reported (bounded: least recent episode out)."""

    def __init__(self, max_episodes: int = 4096) -> None:
        self.max_episodes = max_episodes
        self._episodes: OrderedDict[str, dict[str, str]] = OrderedDict()

    def _links(self, episode_id: str) -> dict[str, str]:
        links = self._episodes.get(episode_id)
        if links is None:
            links = self._episodes[episode_id] = {}
            while len(self._episodes) > self.max_episodes:
                self._episodes.popitem(last=False)
        else:
            self._episodes.move_to_end(episode_id)
        return links

    def resolve(self, episode_id: str, attribution: Attribution) -> Attribution:
        """Record the call's link; fill in a parent the call did not repeat."""
        resolved = dataclasses.replace(attribution, episode_id=episode_id)
        agent, parent = attribution.agent_id, attribution.parent_agent_id
        if agent is None:
            return resolved
        links = self._links(episode_id)
        if parent is not None and parent != agent:
            links.setdefault(agent, parent)
            return resolved
        known = links.get(agent)
        return resolved if known is None else dataclasses.replace(resolved, parent_agent_id=known)

    def lineage(self, episode_id: str, agent_id: str) -> list[str]:
        """``[agent, parent, grandparent, …, root]`` as far as this episode's links go."""
        links = self._episodes.get(episode_id, {})
        chain = [agent_id]
        while chain[-1] in links and links[chain[-1]] not in chain:
            chain.append(links[chain[-1]])
        return chain
