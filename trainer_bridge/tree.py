"""The rows of a batch as a prefix forest: every distinct token prefix appears once.

A compressed trie (radix forest) over the rows' ``input_ids``. A **segment** is a maximal run of
tokens that the same rows share: the group's system prompt and task, an episode's pre-compaction
context, the prompt of ``n > 1`` siblings, one worker's own turns. A row is a path from a root
segment down to the segment where it ends (a row that is a prefix of another ends at a split).
Segments are numbered in preorder (every parent before its children) and their tokens laid out
in that order: the *flat index* of a token. The position of a token is its depth (the length of
its ancestors plus its offset in the segment), the same in every row that contains it.

``plan_scores`` turns "score these (row, position) pairs" into work on the forest. The logprob
of the token at row position ``t`` is read from the logits at position ``t − 1`` of the same
path — inside the segment, or the *last token of the parent segment* for a segment's first
token. Pairs ``(predicting flat index, target token)`` are deduplicated: two rows (of one or of
different episodes) that contain the same token at the same tree position get one logprob, and
each keeps its own loss term (and its own advantage) in the loss. Sharing is only ever shared
*conditioning*.

Work is trimmed too: a segment runs only up to its last predicting position, unless one of its
descendants runs (then it runs whole, for their keys and values); a leaf tail that predicts
nothing scored is never computed. ``TreePlan.computed_tokens`` is what the forward pass processes.

Construction inserts rows one by one, comparing a row with a segment by vectorised numpy (first
mismatch), splitting a segment at a mismatch: O(row tokens) element comparisons plus O(segments
visited) Python steps per row. Pure: no torch, no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainer_bridge.errors import TrainerError


@dataclass(frozen=True, slots=True)
class Segment:
    parent: int  # index of the parent segment; -1 for a root
    depth: int  # position of the first token in every row through it
    offset: int  # flat index of the first token
    tokens: np.ndarray  # [L] int64, read-only


@dataclass(frozen=True, slots=True)
class PrefixForest:
    segments: tuple[Segment, ...]  # preorder: parents before children, siblings by first row
    paths: tuple[tuple[int, ...], ...]  # per row: its segments, root first

    @property
    def distinct_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    @property
    def row_tokens(self) -> int:
        return sum(self.row_length(r) for r in range(len(self.paths)))

    def row_length(self, row: int) -> int:
        last = self.segments[self.paths[row][-1]]
        return last.depth + len(last.tokens)

    def flat_index(self, row: int) -> np.ndarray:
        """``[T_row]``: the flat index of each position of the row."""
        segments = [self.segments[s] for s in self.paths[row]]
        return np.concatenate([np.arange(s.offset, s.offset + len(s.tokens)) for s in segments])


class _Node:
    __slots__ = ("children", "parent", "tokens")

    def __init__(self, tokens: np.ndarray, parent: _Node | None) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}


def _split(node: _Node, at: int) -> _Node:
    """Cut ``node`` after ``at`` tokens; return the new upper half (``node`` keeps the rest)."""
    parent = node.parent
    assert parent is not None
    upper = _Node(node.tokens[:at], parent)
    parent.children[int(node.tokens[0])] = upper
    node.tokens = node.tokens[at:]
    node.parent = upper
    upper.children[int(node.tokens[0])] = node
    return upper


def _insert(root: _Node, ids: np.ndarray) -> _Node:
    """Add one row; return the node it ends at (its last token is that node's last token)."""
    node, depth, n = root, 0, len(ids)
    while depth < n:
        child = node.children.get(int(ids[depth]))
        if child is None:
            leaf = _Node(ids[depth:], node)
            node.children[int(ids[depth])] = leaf
            return leaf
        common = min(len(child.tokens), n - depth)
        differ = np.flatnonzero(child.tokens[:common] != ids[depth : depth + common])
        shared = int(differ[0]) if differ.size else common
        if shared < len(child.tokens):
            child = _split(child, shared)
        depth += shared
        node = child
    return node


def build_forest(rows: Sequence[np.ndarray]) -> PrefixForest:
    """The prefix forest of the rows' token sequences (each ``[T_row]`` int64, non-empty)."""
    if any(len(r) == 0 for r in rows):
        raise TrainerError("a row without tokens cannot be packed", param="input_ids")
    root = _Node(np.zeros(0, dtype=np.int64), None)
    ends = [_insert(root, np.asarray(r, dtype=np.int64)) for r in rows]

    index: dict[int, int] = {}  # id(node) → segment index
    segments: list[Segment] = []
    stack: list[tuple[_Node, int, int]] = [(c, -1, 0) for c in reversed(root.children.values())]
    offset = 0
    while stack:
        node, parent, depth = stack.pop()
        tokens = node.tokens.copy()
        tokens.flags.writeable = False
        index[id(node)] = len(segments)
        segments.append(Segment(parent, depth, offset, tokens))
        offset += len(tokens)
        here = len(segments) - 1
        stack.extend((c, here, depth + len(tokens)) for c in reversed(node.children.values()))

    paths: list[tuple[int, ...]] = []
    for end in ends:
        path: list[int] = []
        cursor: _Node | None = end
        while cursor is not None and cursor is not root:
            path.append(index[id(cursor)])
            cursor = cursor.parent
        paths.append(tuple(reversed(path)))
    return PrefixForest(tuple(segments), tuple(paths))


@dataclass(frozen=True, slots=True)
class TreePlan:
    """What to run and which logprobs to read, for scoring ``E`` (row, position) entries.

    ``U`` distinct (predicting flat index, target token) pairs, sorted by predicting index, so
    the pairs of each segment are contiguous (``pair_bounds``) and come in segment order.
    """

    forest: PrefixForest
    run_length: np.ndarray  # [S] tokens of each segment the forward pass runs (0: skipped)
    keep: tuple[np.ndarray, ...]  # per segment: sorted local offsets whose logits are read
    pair_keep: np.ndarray  # [U] index of the pair's predicting position in its segment's keep
    pair_target: np.ndarray  # [U] the token whose logprob is read
    pair_bounds: np.ndarray  # [S + 1] pairs of segment s: pair_bounds[s] : pair_bounds[s + 1]
    entry_row: np.ndarray  # [E]
    entry_pos: np.ndarray  # [E] row position t ≥ 1 of the scored token
    entry_pair: np.ndarray  # [E] index into the pairs

    @property
    def computed_tokens(self) -> int:
        return int(self.run_length.sum())

    def running_children(self) -> np.ndarray:
        """``[S]`` how many children of each segment run (a segment with some keeps its K/V)."""
        counts = np.zeros(len(self.forest.segments), dtype=np.int64)  # [S]
        for s, seg in enumerate(self.forest.segments):
            if seg.parent >= 0 and self.run_length[s] > 0:
                counts[seg.parent] += 1
        return counts


def plan_scores(rows: Sequence[np.ndarray], score: Sequence[np.ndarray]) -> TreePlan:
    """Plan the logprobs of ``rows[b][t]`` for every ``t ≥ 1`` with ``score[b][t]`` true."""
    forest = build_forest(rows)
    num_segments = len(forest.segments)
    offsets = np.array([s.offset for s in forest.segments] + [forest.distinct_tokens])  # [S+1]

    entry_row, entry_pos, entry_pred, entry_target = [], [], [], []
    for b, (ids, mask) in enumerate(zip(rows, score, strict=True)):
        positions = np.flatnonzero(np.asarray(mask, dtype=bool)[1:]) + 1  # [e_b], t ≥ 1
        flat = forest.flat_index(b)  # [T_b]
        entry_row.append(np.full(len(positions), b, dtype=np.int64))
        entry_pos.append(positions)
        entry_pred.append(flat[positions - 1])  # the token before t predicts t
        entry_target.append(np.asarray(ids, dtype=np.int64)[positions])
    rows_e = np.concatenate(entry_row)  # [E]
    pos_e = np.concatenate(entry_pos).astype(np.int64)  # [E]
    pred_e = np.concatenate(entry_pred).astype(np.int64)  # [E]
    target_e = np.concatenate(entry_target)  # [E]

    width = int(target_e.max()) + 1 if target_e.size else 1
    pairs, entry_pair = np.unique(pred_e * width + target_e, return_inverse=True)  # [U], [E]
    pair_pred, pair_target = pairs // width, pairs % width  # [U], [U]
    pair_segment = np.searchsorted(offsets, pair_pred, side="right") - 1  # [U]
    pair_bounds = np.searchsorted(pair_segment, np.arange(num_segments + 1))  # [S+1]

    keep: list[np.ndarray] = []
    pair_keep = np.empty(len(pairs), dtype=np.int64)  # [U]
    run_length = np.zeros(num_segments, dtype=np.int64)  # [S]
    for s in range(num_segments):
        lo, hi = pair_bounds[s], pair_bounds[s + 1]
        local = pair_pred[lo:hi] - offsets[s]  # sorted
        kept, where = np.unique(local, return_inverse=True)
        keep.append(kept)
        pair_keep[lo:hi] = where
        run_length[s] = int(kept[-1]) + 1 if kept.size else 0
    for s in reversed(range(num_segments)):  # children after parents: fold upwards
        parent = forest.segments[s].parent
        if parent >= 0 and run_length[s] > 0:
            run_length[parent] = len(forest.segments[parent].tokens)

    return TreePlan(
        forest=forest,
        run_length=run_length,
        keep=tuple(keep),
        pair_keep=pair_keep,
        pair_target=pair_target,
        pair_bounds=pair_bounds,
        entry_row=rows_e,
        entry_pos=pos_e,
        entry_pair=entry_pair.reshape(-1),
    )
