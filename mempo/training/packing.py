"""Prefix-tree packing: sequences that share leading tokens, scored with the prefix run once.

The memory reward scores the gold answer after every turn's full history (`mempo.advantage`):
turn t's probe is the history through turn t-1 plus the answer, and turn t+1's history starts
with all of it. Scored one row each, an episode of T turns runs its history about T / 2
times. Packed, the longest probe (the trunk) runs once, keeping its keys and values, and every
other probe that starts like it runs only its own tail (a branch: the answer probe tag and the
answer) on top of the trunk's first `shared` tokens' cache, with the position ids it has in its
own sequence. Every token then sees exactly the tokens before it in its own sequence, so its
logits are the ones its own row would give (`mempo.advantage.answer_probability(packed=True)`).

    packs = pack_sequences(seqs, first_scored)     # greedy, longest sequences first
    packs[0].trunk, [(b.seq, b.shared) for b in packs[0].branches]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A sequence joins a trunk as a branch only when it shares at least this many leading tokens
# with it, more than it adds, and adds at most MAX_BRANCH_TOKENS: a branch runs under an
# explicit mask (no causal kernel), so long branches would cost more than they save.
MIN_SHARED_TOKENS = 16
MAX_BRANCH_TOKENS = 256


@dataclass(frozen=True)
class Branch:
    """Sequence `seq` in a pack: its first `shared` tokens are the trunk's."""

    seq: int
    shared: int


@dataclass
class Pack:
    """A trunk (a whole sequence) and the branches that share its leading tokens."""

    trunk: int
    branches: list[Branch] = field(default_factory=list)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def pack_sequences(seqs: Sequence[Sequence[int]], first_scored: Sequence[int],
                   min_shared: int = MIN_SHARED_TOKENS, max_branch: int = MAX_BRANCH_TOKENS) -> list[Pack]:
    """Greedy prefix-tree packs of `seqs`, longest first: each sequence becomes a branch of
    the pack whose trunk shares the most leading tokens with it (at least `min_shared`, more
    than the branch adds, and the branch adds at most `max_branch`), else the trunk of a new
    pack. A branch shares at most `first_scored[i]` tokens, so every
    position whose logits are read (`first_scored[i]` and after) is the branch's own. Every
    sequence is in exactly one pack."""
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    packs: list[Pack] = []
    by_start: dict[tuple[int, ...], list[int]] = defaultdict(list)  # first tokens -> packs whose trunk has them
    for i in order:
        key = tuple(seqs[i][:min_shared])
        best, best_shared = -1, 0
        if len(seqs[i]) > min_shared:
            for k in by_start[key]:
                shared = min(_common_prefix(arrays[packs[k].trunk], arrays[i]), first_scored[i])
                tail = len(seqs[i]) - shared
                if shared >= max(min_shared, tail) and tail <= max_branch and shared > best_shared:
                    best, best_shared = k, shared
        if best >= 0:
            packs[best].branches.append(Branch(i, best_shared))
        else:
            by_start[key].append(len(packs))
            packs.append(Pack(i))
    return packs
