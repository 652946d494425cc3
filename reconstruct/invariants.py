"""Invariants of a reconstruction (DESIGN §5), as a list of violations — empty when all hold.

Used by the tests and usable as a runtime self-check. Checked from the bundle and the output only:

- rows are numbered ``{episode_id}/{i}``, carry the episode's group and reward, and own something;
- each row's ``input_ids`` equal its endpoint's prompt + completion (its last span's call), and
  each span's call has ``input_ids[:start]`` as its prompt and ``input_ids[start:end]`` as its
  completion;
- ``loss_mask`` is 1 exactly on owned spans; ``behavior_logprobs`` are the call's captured logprobs
  there and 0.0 elsewhere;
- every ``trained`` call is owned exactly once (an empty completion at most once), nothing else;
- the accounting classifies every call exactly once and its figures match the rows.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from capture_contracts.bundle import CallRecord, EpisodeBundle
from capture_contracts.rows import Row
from reconstruct.records import Reconstruction


def _expected_mask(
    row: Row, calls: dict[str, CallRecord], out: list[str]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Check each span against its call; the mask and logprobs its owned spans imply."""
    mask = np.zeros(len(row.input_ids), dtype=np.int64)
    logprobs = np.zeros(len(row.input_ids), dtype=np.float64)
    for span in row.spans:
        call = calls[span.call_id]
        prompt, completion = call.prompt_token_ids, call.completion_token_ids
        if span.start != len(prompt) or span.end != len(prompt) + len(completion):
            out.append(f"row {row.row_id}: span {span.call_id} has wrong bounds")
            continue
        if not np.array_equal(row.input_ids[: span.start], prompt) or not np.array_equal(
            row.input_ids[span.start : span.end], completion
        ):
            out.append(f"row {row.row_id}: span {span.call_id} is not the call's prompt + output")
        if span.owned:
            mask[span.start : span.end] = 1
            logprobs[span.start : span.end] = call.completion_logprobs
    return mask, logprobs


def _row_violations(row: Row, index: int, bundle: EpisodeBundle) -> list[str]:
    calls = {c.call_id: c for c in bundle.calls}
    out: list[str] = []
    where = f"row {row.row_id}"
    if row.row_id != f"{bundle.episode_id}/{index}":
        out.append(f"{where}: row_id is not {bundle.episode_id}/{index}")
    if (row.episode_id, row.group_id, row.reward) != (
        bundle.episode_id,
        bundle.group_id,
        bundle.reward,
    ):
        out.append(f"{where}: episode, group or reward differ from the bundle")
    n = len(row.input_ids)
    if not (len(row.loss_mask) == len(row.behavior_logprobs) == n):
        return [*out, f"{where}: input_ids, loss_mask and behavior_logprobs differ in length"]
    if not row.spans:
        return [*out, f"{where}: no spans"]
    endpoint = calls[row.spans[-1].call_id]
    expected = np.concatenate((endpoint.prompt_token_ids, endpoint.completion_token_ids))
    if not np.array_equal(row.input_ids, expected):
        out.append(f"{where}: input_ids are not the endpoint's prompt + completion")
    mask, logprobs = _expected_mask(row, calls, out)
    if not np.array_equal(mask, row.loss_mask):
        out.append(f"{where}: loss_mask is not 1 exactly on owned spans")
    if not np.array_equal(logprobs, row.behavior_logprobs):
        out.append(f"{where}: behavior_logprobs do not match the owned spans")
    if not mask.any():
        out.append(f"{where}: owns nothing")
    return out


def invariant_violations(bundle: EpisodeBundle, result: Reconstruction) -> list[str]:
    """Every violated invariant, as a readable message."""
    out: list[str] = []
    for index, row in enumerate(result.rows):
        out.extend(_row_violations(row, index, bundle))
    acc = result.accounting
    classes = acc.classification
    if sorted(classes) != sorted(c.call_id for c in bundle.calls) or acc.n_calls != len(
        bundle.calls
    ):
        out.append("accounting: not every call is classified exactly once")
    if sum(acc.counts.values()) != acc.n_calls:
        out.append("accounting: counts do not add up to the calls admitted")
    owners = Counter(s.call_id for row in result.rows for s in row.spans if s.owned)
    for call in bundle.calls:
        trained = classes.get(call.call_id) == "trained"
        allowed = ({1} if len(call.completion_token_ids) else {0, 1}) if trained else {0}
        if owners[call.call_id] not in allowed:
            out.append(
                f"call {call.call_id} ({classes.get(call.call_id)}) is owned "
                f"{owners[call.call_id]} times"
            )
    if acc.rows != len(result.rows):
        out.append("accounting: row count differs from the rows")
    if acc.row_tokens != sum(len(r.input_ids) for r in result.rows):
        out.append("accounting: row_tokens differ from the rows")
    if acc.owned_tokens != sum(int(r.loss_mask.sum()) for r in result.rows):
        out.append("accounting: owned_tokens differ from the rows")
    return out
