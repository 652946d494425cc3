"""Unit tests of the individual rules of DESIGN §5 on small hand-built episodes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from reconstruct import forest as forest_module
from reconstruct import parse_bundle, reconstruct_episode
from reconstruct.errors import EpisodeRefused, ReconstructionError
from reconstruct.forest import PrefixHasher
from reconstruct.invariants import invariant_violations
from tests.golden.make_golden import SCENARIOS
from tests.support.builders import EpisodeBuilder


def _classes(bundle: dict[str, Any]) -> dict[str, str]:
    return dict(reconstruct_episode(bundle).accounting.classification)


def test_prefix_hashes_agree_with_hashing_the_prefix_alone() -> None:
    hasher = PrefixHasher(50)
    tokens = np.arange(1, 41, dtype=np.int64) * 7919 % 1000
    full = hasher.prefix_hashes(tokens)
    for n in (0, 1, 17, 40):
        assert hasher.prefix_hashes(tokens[:n])[-1] == full[n]
    assert len(set(full.tolist())) == 41


def test_ordering_guard_concurrent_call_is_not_a_parent() -> None:
    # b admitted before a completed: a's sequence is a prefix of b's prompt, but not its parent
    b = EpisodeBuilder()
    b.admit("a", [1, 2], agent="x")
    b.admit("b", [1, 2, 3, 4, 5], agent="x")
    b.complete("a", [3, 4])
    b.complete("b", [6])
    result = reconstruct_episode(b.bundle())
    assert result.parents == {"a": None, "b": None}
    assert len(result.rows) == 2


def test_longest_prefix_wins() -> None:
    b = EpisodeBuilder()
    full_a = b.call("a", [1, 2], completion=[3])
    full_b = b.call("b", [*full_a, 4], completion=[5])
    b.call("c", [*full_b, 6], completion=[7])
    assert reconstruct_episode(b.bundle()).parents == {"a": None, "b": "a", "c": "b"}


def test_tie_prefers_same_agent_over_later_completion() -> None:
    b = EpisodeBuilder()
    b.call("x-own", [1], completion=[2], agent="w")
    b.call("x-other", [1], completion=[2], agent="v")  # completed later, other agent
    b.call("child", [1, 2, 3], agent="w")
    result = reconstruct_episode(b.bundle())
    assert result.parents["child"] == "x-own"
    assert result.accounting.ambiguous_parent == ()


def test_tie_without_agent_is_latest_completed_and_ambiguous() -> None:
    b = EpisodeBuilder()
    b.call("first", [1], completion=[2])
    b.call("second", [1], completion=[2])
    b.call("child", [1, 2, 3])
    result = reconstruct_episode(b.bundle())
    assert result.parents["child"] == "second"
    assert result.accounting.ambiguous_parent == ("child",)


def test_unlabelled_retry_is_discarded_but_not_across_labels() -> None:
    b = EpisodeBuilder()
    b.call("try1", [1, 2])
    b.call("try2", [1, 2])
    b.call("other", [1, 2], agent="z")  # a different (labelled) agent: not a retry of try2
    assert _classes(b.bundle()) == {
        "try1": "discarded_retry",
        "try2": "trained",
        "other": "trained",
    }


def test_rollback_needs_labelled_agents() -> None:
    b = EpisodeBuilder()
    full_a1 = b.call("a1", [1])
    b.call("a2", [*full_a1, 5])
    b.call("a2b", [*full_a1, 6])
    assert _classes(b.bundle())["a2"] == "trained"  # unlabelled: no rule 3c


def test_accepted_mark_overrides_retry() -> None:
    b = EpisodeBuilder()
    b.call("t1", [1, 2], agent="a", mark="accepted")
    b.call("t2", [1, 2], agent="a")
    result = reconstruct_episode(b.bundle())
    assert result.accounting.classification == {"t1": "trained", "t2": "trained"}
    assert result.accounting.ineffective_marks == ()


def test_mark_on_failed_call_is_reported() -> None:
    b = EpisodeBuilder()
    b.call("ok", [1])
    b.admit("bad", [1], mark="discarded")
    b.end("bad", "failed")
    notes = reconstruct_episode(b.bundle()).accounting.ineffective_marks
    assert [(n.call_id, n.reason) for n in notes] == [("bad", "call_not_completed")]


def test_unresolved_calls_refuse_the_episode() -> None:
    b = EpisodeBuilder()
    b.call("ok", [1])
    b.admit("hanging", [1, 2])
    with pytest.raises(EpisodeRefused, match="unresolved") as info:
        reconstruct_episode(b.bundle())
    assert info.value.code == "unresolved_calls"


def test_open_episode_is_refused() -> None:
    b = EpisodeBuilder()
    b.call("ok", [1])
    bundle = dict(b.bundle(), status="open")
    with pytest.raises(EpisodeRefused, match="still open"):
        reconstruct_episode(bundle)


def test_trainable_roles_option() -> None:
    bundle = SCENARIOS["chain20_compaction"]()
    result = reconstruct_episode(bundle, trainable_roles={"policy"})
    assert result.accounting.classification["compact"] == "conditioning_only"
    assert result.accounting.owned_tokens == 57  # 19 policy calls × 3
    assert invariant_violations(parse_bundle(bundle), result) == []
    with pytest.raises(ReconstructionError, match="unknown trainable role"):
        reconstruct_episode(bundle, trainable_roles={"critic"})


def test_empty_completion_is_reported() -> None:
    b = EpisodeBuilder()
    full = b.call("a", [1, 2], completion=[])
    b.call("b", [*full, 3])
    bundle = b.bundle()
    result = reconstruct_episode(bundle)
    assert result.accounting.empty_completions == ("a",)
    assert invariant_violations(parse_bundle(bundle), result) == []


def test_typed_bundle_is_accepted() -> None:
    bundle = SCENARIOS["nested_forks"]()
    typed = reconstruct_episode(parse_bundle(bundle))
    assert [r.to_dict() for r in typed.rows] == [
        r.to_dict() for r in reconstruct_episode(bundle).rows
    ]


class _CollidingHasher(PrefixHasher):
    """Every prefix hashes to its length only: all lookups collide, verification decides."""

    def prefix_hashes(self, tokens: Any) -> Any:
        return np.zeros(len(tokens) + 1, dtype=np.uint64)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_hash_collisions_do_not_change_results(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = SCENARIOS[name]()
    expected = reconstruct_episode(bundle)
    monkeypatch.setattr(forest_module, "PrefixHasher", _CollidingHasher)
    colliding = reconstruct_episode(bundle)
    assert [r.to_dict() for r in colliding.rows] == [r.to_dict() for r in expected.rows]
    assert colliding.accounting == expected.accounting
