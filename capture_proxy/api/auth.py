"""Access control: the admin key for episode management, one API key per episode.

Without ``auth.admin_key`` everything is open (loopback dev mode; ``capture-proxy serve`` refuses
any other address, :func:`refusal_to_bind`). With it:

- the episode REST API needs ``Authorization: Bearer <admin key>`` (:func:`require_admin`);
- ``POST /episodes`` answers the new episode's own ``api_key`` once; the store keeps only its
  SHA-256 (``episodes.api_key_hash``). The keys are 256 random bits, so a plain digest is as
  good as a slow password hash here and costs nothing per call;
- an episode's OpenAI routes (by path, or ``/v1/…`` with ``X-Episode-Id``) need that key, as
  ``Authorization: Bearer …`` or ``x-api-key: …`` (Anthropic-style clients), or the admin key
  (:func:`authorize_episode`). A key opens its own episode only; an unknown episode answers 401
  to anyone but the admin, so keys cannot probe which episodes exist.

Comparisons are constant-time (``hmac.compare_digest``); no key is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from fastapi import Request

from capture_proxy.errors import Unauthorized
from capture_proxy.settings import Settings
from capture_proxy.store.repository import Store

KEY_PREFIX = "cpk_"


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _admin_key(request: Request) -> str | None:
    settings: Settings = request.app.state.settings
    key = settings.auth.admin_key
    return None if key is None else key.get_secret_value()


def auth_enabled(request: Request) -> bool:
    return _admin_key(request) is not None


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is(presented: str, expected: str) -> bool:
    return hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


async def require_admin(request: Request) -> None:
    """Dependency of the episode REST API."""
    admin = _admin_key(request)
    if admin is None:
        return
    presented = _bearer(request)
    if presented is None or not _is(presented, admin):
        raise Unauthorized(
            "episode management needs the admin key: Authorization: Bearer <admin key>",
            code="admin_key_required",
        )


async def authorize_episode(request: Request, episode_id: str | None) -> None:
    """An OpenAI route of ``episode_id`` (None: no episode named) may be served."""
    admin = _admin_key(request)
    if admin is None:
        return
    presented = _bearer(request) or request.headers.get("x-api-key")
    if presented and _is(presented, admin):
        return
    if presented and episode_id is not None:
        store: Store = request.app.state.service.store
        known = await store.keys.digest(episode_id)
        if (
            known is not None
            and known.digest is not None
            and _is(key_digest(presented), known.digest)
        ):
            return
    raise Unauthorized(
        "this route needs the episode's API key (answered by POST /episodes) as "
        "Authorization: Bearer <key> or x-api-key: <key>",
        code="episode_key_required",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refusal_to_bind(settings: Settings) -> str | None:
    """The one line ``serve`` prints instead of starting, or None when it may start."""
    if settings.auth.admin_key is not None or is_loopback(settings.host):
        return None
    return (
        f"capture-proxy serve: refusing to listen on {settings.host} without an admin key: "
        "anyone who reaches the port could read and write every episode; pass --admin-key KEY "
        "(or set CAPTURE_PROXY_AUTH__ADMIN_KEY), or listen on 127.0.0.1"
    )
