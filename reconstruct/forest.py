"""The forest of contexts: parent links by exact token prefix (DESIGN §5 rules 1–2).

Nodes are the completed calls, in canonical order ``(admitted_seq, call_id)`` so that nothing
depends on the order calls are listed in a bundle. A parent always sorts before its child (it
completed before the child was admitted), so one forward pass can compute anything top-down.

Parent of C: among nodes P with ``P.completed_seq < C.admitted_seq`` whose ``P.prompt +
P.completion`` ("full sequence") is a prefix of ``C.prompt``, the longest; ties (identical
sequences) go to the same agent as C, then to the latest completed (then latest admitted, then the
largest call id, so the choice is total). A tie not decided by the agent id is reported as
``ambiguous_parent``.

Complexity. Let T be the total number of tokens in the bundle (all prompts and completions) and N
the number of calls. Every node's full sequence is hashed once with a polynomial rolling hash
computed in numpy (``O(len)``), giving the hash of each of its prefixes; full sequences go into a
dict keyed by ``(length, hash)``. For a call C we probe the dict only at lengths that are the
length of some node's full sequence and at most ``len(C.prompt)``, longest first, and stop at the
first length with a candidate that passes the ordering guard and whose sequence is verified equal
(``numpy.array_equal`` on ``len ≤ len(C.prompt)`` tokens). Building is ``O(T)`` numpy work plus
``O(N log N)`` sorting; each call does ``O(min(N, len(C.prompt)))`` dict probes and, barring hash
collisions, one ``O(len(C.prompt))`` verification. Total ``O(T + N log N)`` — never
tokens × calls².
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from capture_contracts.bundle import CallRecord, IntArray

HashArray = npt.NDArray[np.uint64]

_BASE = 0x9E3779B97F4A7C15  # odd, hence invertible modulo 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)


class PrefixHasher:
    """Polynomial hashes modulo 2**64 of every prefix of a token array, vectorised.

    ``h[i] = sum_{j<i} x[j] * B**(i-1-j)`` is computed as ``B**i * cumsum(x[j] * B**-(j+1))``;
    uint64 array arithmetic wraps modulo 2**64 without warnings.
    """

    def __init__(self, max_len: int) -> None:
        n = max_len + 1
        self._pow = np.cumprod(np.full(n, _BASE, dtype=np.uint64), dtype=np.uint64)  # B**1..B**n
        self._inv = np.cumprod(np.full(n, _BASE_INV, dtype=np.uint64), dtype=np.uint64)

    def prefix_hashes(self, tokens: IntArray) -> HashArray:
        """``out[i]`` is the hash of ``tokens[:i]``, for ``i`` in ``0..len(tokens)``."""
        n = len(tokens)
        out = np.zeros(n + 1, dtype=np.uint64)
        if n:
            weighted = tokens.astype(np.uint64) * self._inv[:n]  # x[j] * B**-(j+1)
            out[1:] = self._pow[:n] * np.cumsum(weighted, dtype=np.uint64)
        return out


@dataclass(slots=True)
class _Group:
    """Nodes whose full sequences are identical (one representative array)."""

    sequence: IntArray
    members: list[int]


@dataclass(frozen=True, slots=True)
class Forest:
    """Completed calls linked to their parents. Indices refer to ``nodes``."""

    nodes: tuple[CallRecord, ...]
    full: tuple[IntArray, ...]  # prompt + completion of each node
    prompt_hash: tuple[int, ...]  # hash of each node's prompt (for retry detection)
    parent: tuple[int | None, ...]
    children: tuple[tuple[int, ...], ...]
    ambiguous_parent: tuple[int, ...]  # nodes whose parent tie was broken without an agent id

    def root_of(self) -> list[int]:
        """Index of each node's root (one forward pass: parents precede children)."""
        roots: list[int] = []
        for i, p in enumerate(self.parent):
            roots.append(i if p is None else roots[p])
        return roots

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        out = [node]
        p = self.parent[node]
        while p is not None:
            out.append(p)
            p = self.parent[p]
        out.reverse()
        return out


def _frozen_concat(prompt: IntArray, completion: IntArray) -> IntArray:
    out = np.concatenate((prompt, completion))
    out.flags.writeable = False
    return out


def _seq(call: CallRecord) -> int:
    assert call.completed_seq is not None  # completed calls always have one (parse_bundle)
    return call.completed_seq


def _same_labelled_agent(a: CallRecord, b: CallRecord) -> bool:
    return a.agent_id is not None and a.agent_id == b.agent_id


def _pick_parent(candidates: list[int], child: CallRecord, nodes: Sequence[CallRecord]) -> int:
    same_agent = [p for p in candidates if _same_labelled_agent(nodes[p], child)]
    pool = same_agent or candidates
    return max(pool, key=lambda p: (_seq(nodes[p]), nodes[p].admitted_seq, nodes[p].call_id))


def _is_ambiguous(candidates: list[int], child: CallRecord, nodes: Sequence[CallRecord]) -> bool:
    same_agent = [p for p in candidates if _same_labelled_agent(nodes[p], child)]
    return len(same_agent or candidates) > 1


def _longest_candidates(
    child: CallRecord,
    prefix_hashes: HashArray,
    lengths: list[int],
    buckets: dict[tuple[int, int], list[_Group]],
    nodes: Sequence[CallRecord],
) -> list[int]:
    """Nodes completed before ``child`` was admitted whose full sequence is the longest prefix of
    its prompt (all identical sequences); empty when there is none. Probes lengths longest first."""
    prompt = child.prompt_token_ids
    for k in range(bisect_right(lengths, len(prompt)) - 1, -1, -1):
        length = lengths[k]
        for group in buckets.get((length, int(prefix_hashes[length])), ()):
            valid = [p for p in group.members if _seq(nodes[p]) < child.admitted_seq]
            if valid and np.array_equal(group.sequence, prompt[:length]):
                return valid
    return []


def build_forest(calls: Sequence[CallRecord]) -> Forest:
    """Link every completed call to its parent (rule 2). Pure; ``O(T + N log N)``."""
    completed = (c for c in calls if c.status == "completed")
    nodes = tuple(sorted(completed, key=lambda c: (c.admitted_seq, c.call_id)))
    full = tuple(_frozen_concat(c.prompt_token_ids, c.completion_token_ids) for c in nodes)
    hasher = PrefixHasher(max((len(f) for f in full), default=0))
    hashes = [hasher.prefix_hashes(f) for f in full]

    buckets: dict[tuple[int, int], list[_Group]] = {}
    for i, seq in enumerate(full):
        groups = buckets.setdefault((len(seq), int(hashes[i][-1])), [])
        for group in groups:
            if np.array_equal(group.sequence, seq):
                group.members.append(i)
                break
        else:
            groups.append(_Group(seq, [i]))
    lengths = sorted({len(seq) for seq in full})

    parent: list[int | None] = []
    ambiguous: list[int] = []
    for c_index, child in enumerate(nodes):
        found = _longest_candidates(child, hashes[c_index], lengths, buckets, nodes)
        if not found:
            parent.append(None)
            continue
        parent.append(_pick_parent(found, child, nodes))
        if _is_ambiguous(found, child, nodes):
            ambiguous.append(c_index)

    children: list[list[int]] = [[] for _ in nodes]
    for i, p in enumerate(parent):
        if p is not None:
            children[p].append(i)
    prompt_hash = tuple(int(hashes[i][len(c.prompt_token_ids)]) for i, c in enumerate(nodes))
    return Forest(
        nodes=nodes,
        full=full,
        prompt_hash=prompt_hash,
        parent=tuple(parent),
        children=tuple(tuple(ch) for ch in children),
        ambiguous_parent=tuple(ambiguous),
    )
