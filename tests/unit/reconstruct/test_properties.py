"""Property tests over random episode forests (DESIGN §5 invariants)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconstruct import parse_bundle, reconstruct_episode
from reconstruct.invariants import invariant_violations
from tests.oracles.reference import eligible_call_ids, naive_parents, reference_rows
from tests.support.strategies import episodes

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(episodes())
def test_invariants_hold(bundle: dict[str, Any]) -> None:
    result = reconstruct_episode(bundle)
    assert invariant_violations(parse_bundle(bundle), result) == []


@PROPERTY
@given(episodes(), st.randoms(use_true_random=False))
def test_rows_do_not_depend_on_call_order(bundle: dict[str, Any], rnd: random.Random) -> None:
    shuffled = dict(bundle, calls=rnd.sample(bundle["calls"], len(bundle["calls"])))
    first, second = reconstruct_episode(bundle), reconstruct_episode(shuffled)
    assert [r.to_dict() for r in first.rows] == [r.to_dict() for r in second.rows]
    assert first.accounting.to_dict() == second.accounting.to_dict()
    assert first.parents == second.parents


@PROPERTY
@given(episodes())
def test_forest_and_eligibility_match_the_naive_transcription(bundle: dict[str, Any]) -> None:
    result = reconstruct_episode(bundle)
    assert dict(result.parents) == naive_parents(parse_bundle(bundle).calls)
    trained = {c for c, k in result.accounting.classification.items() if k == "trained"}
    assert trained == eligible_call_ids(bundle)


@PROPERTY
@given(episodes())
def test_each_generation_owned_by_the_first_row_containing_it(bundle: dict[str, Any]) -> None:
    result = reconstruct_episode(bundle)
    seen: set[str] = set()
    for row in result.rows:
        for span in row.spans:
            assert not (span.owned and span.call_id in seen)
        seen.update(span.call_id for span in row.spans)
    owned = {s.call_id for row in result.rows for s in row.spans if s.owned}
    assert owned == {r.call_id for r in reference_rows(bundle)}


@PROPERTY
@given(episodes())
def test_token_figures_match_the_reference(
    bundle: dict[str, Any],
) -> None:
    result = reconstruct_episode(bundle)
    reference = reference_rows(bundle)
    acc = result.accounting
    assert acc.owned_tokens == sum(sum(r.loss_mask) for r in reference)
    assert acc.reference_tokens == sum(len(r.input_ids) for r in reference)
    # (row_tokens may exceed reference_tokens: an auxiliary endpoint's row can own its ancestors)
    counts = acc.counts
    assert sum(counts.values()) == len(bundle["calls"])
    assert counts["unresolved"] == 0
