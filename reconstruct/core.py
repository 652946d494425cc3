"""``reconstruct_episode``: one closed episode's calls → training rows + accounting (DESIGN §5).

Pure: no I/O, no clock, no randomness; the result does not depend on the order calls are listed.
Cost ``O(T + N log N)`` for T tokens and N calls (see :mod:`reconstruct.forest`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from capture_contracts.bundle import EpisodeBundle, check_bundle, parse_bundle
from capture_contracts.vocabulary import DEFAULT_TRAINABLE_ROLES, ROLES
from reconstruct.accounting import build_accounting, classify
from reconstruct.discard import find_discards
from reconstruct.errors import EpisodeRefused, ReconstructionError
from reconstruct.forest import build_forest
from reconstruct.records import Reconstruction
from reconstruct.rows import build_rows


def as_bundle(bundle: Mapping[str, Any] | EpisodeBundle) -> EpisodeBundle:
    """Accept the parsed JSON dict or the typed record."""
    return check_bundle(bundle) if isinstance(bundle, EpisodeBundle) else parse_bundle(bundle)


def check_trainable_roles(trainable_roles: Collection[str]) -> frozenset[str]:
    roles = frozenset(trainable_roles)
    unknown = roles - ROLES
    if unknown:
        raise ReconstructionError(
            f"unknown trainable role(s) {sorted(unknown)}; roles are {sorted(ROLES)}",
            param="trainable_roles",
        )
    return roles


def reconstruct_episode(
    bundle: Mapping[str, Any] | EpisodeBundle,
    *,
    trainable_roles: Collection[str] = DEFAULT_TRAINABLE_ROLES,
) -> Reconstruction:
    """Rows and accounting of one closed episode.

    Raises :class:`~capture_contracts.errors.InvalidBundle` for a malformed bundle and
    :class:`~reconstruct.errors.EpisodeRefused` for an episode still ``open``, with unresolved
    calls, or whose accounting does not add up; no rows are produced for a refused episode.
    """
    episode = as_bundle(bundle)
    roles = check_trainable_roles(trainable_roles)
    if episode.status == "open":
        raise EpisodeRefused(
            f"episode {episode.episode_id!r} is still open; only closed episodes are reconstructed",
            code="episode_open",
        )
    unresolved = sorted(c.call_id for c in episode.calls if c.status == "admitted")
    if unresolved:
        raise EpisodeRefused(
            f"episode {episode.episode_id!r}: {len(unresolved)} unresolved call(s) "
            f"{unresolved[:5]}",
            code="unresolved_calls",
        )
    forest = build_forest(episode.calls)
    discards = find_discards(forest)
    eligible = {
        i for i, call in enumerate(forest.nodes) if call.role in roles and i not in discards.reason
    }
    rows = build_rows(episode, forest, discards, eligible)
    classification = classify(episode, forest, discards, roles)
    accounting = build_accounting(episode, forest, discards, classification, rows)
    parents = {
        call.call_id: None if p is None else forest.nodes[p].call_id
        for call, p in zip(forest.nodes, forest.parent, strict=True)
    }
    return Reconstruction(rows=rows, accounting=accounting, parents=dict(sorted(parents.items())))
