"""A small deterministic byte-level BPE trainer, for synthetic tokenizers.

Pieces. The corpus is cut into pieces with the Kimi split pattern, using the ``regex``
module (a dependency of tiktoken, so always present) in its version-1 mode, the one where
``&&`` means class intersection. tiktoken does not expose its own splitter, so the tests
check this one against it: with every piece made a rank, tiktoken's tokens of the corpus
are exactly these pieces. A corpus that is not valid UTF-8 is split as text with its
invalid bytes carried as escapes (they land in punctuation pieces) and trained on verbatim.

Merges. Distinct pieces are counted; within each, adjacent symbols (initially the 256
single bytes) form pairs; the pair with the highest count is merged next, ties going to the
smaller concatenated bytes, then the smaller left and right ids, so the result depends on
the corpus alone. Pairs seen once are merged too, until either ``n_merges`` new tokens exist
or every piece is a single symbol. A merge whose bytes are already a token (reachable by a
different split) reuses it and adds no rank.

Fill. :func:`fill_tokens` extends a vocabulary to an exact size when the corpus has taught
all it can: each new token is an existing token of fewer than :data:`FILL_MAX_BYTES` bytes
followed by one printable ASCII byte, drawn with ``random.Random(seed)``. Every filled
token is thus the concatenation of two tokens that already have ranks, as a BPE vocabulary
requires, and the seed only changes this tail.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Iterable
from itertools import pairwise

import regex

from k3core.tokenizer.encoding import KIMI_PAT_STR

FILL_MAX_BYTES = 32
_PRINTABLE = bytes(range(0x20, 0x7F))


def piece_regex() -> regex.Pattern[str]:
    """The Kimi pattern compiled for the ``regex`` module (version-1 set operations)."""
    return regex.compile(KIMI_PAT_STR, flags=regex.V1)


def split_pieces(data: bytes) -> list[bytes]:
    """The pre-tokenised pieces of ``data``, as raw bytes, in order."""
    text = data.decode("utf-8", "surrogateescape")
    return [p.encode("utf-8", "surrogateescape") for p in piece_regex().findall(text)]


def train_bpe(corpus: bytes, n_merges: int) -> list[bytes]:
    """Up to ``n_merges`` new tokens (beyond the 256 bytes), in rank order."""
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    id_of: dict[bytes, int] = {t: i for i, t in enumerate(vocab)}
    counts = Counter(p for p in split_pieces(corpus) if len(p) > 1)
    words: list[list[int]] = [list(p) for p in sorted(counts)]
    freq: list[int] = [counts[p] for p in sorted(counts)]

    pair_count: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for w, syms in enumerate(words):
        for pair in pairwise(syms):
            pair_count[pair] = pair_count.get(pair, 0) + freq[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-c, vocab[a] + vocab[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    learned: list[bytes] = []
    while heap and len(learned) < n_merges:
        neg, merged, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg or neg == 0:
            continue  # stale entry
        new = id_of.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            id_of[merged] = new
            learned.append(merged)
        touched: set[tuple[int, int]] = set()
        for w in sorted(where.pop((a, b), ())):
            syms = words[w]
            merged_syms = _merge(syms, a, b, new)
            if len(merged_syms) == len(syms):
                continue
            for pair in pairwise(syms):
                pair_count[pair] -= freq[w]
                touched.add(pair)
            for pair in pairwise(merged_syms):
                pair_count[pair] = pair_count.get(pair, 0) + freq[w]
                where.setdefault(pair, set()).add(w)
                touched.add(pair)
            words[w] = merged_syms
        for pair in sorted(touched):
            c = pair_count[pair]
            if c > 0:
                heapq.heappush(heap, (-c, vocab[pair[0]] + vocab[pair[1]], pair[0], pair[1]))
            else:
                del pair_count[pair]
    return learned


def fill_tokens(existing: Iterable[bytes], n: int, seed: int) -> list[bytes]:
    """``n`` new distinct tokens, each an existing token plus one printable byte."""
    pool = list(existing)
    have = set(pool)
    short = [t for t in pool if len(t) < FILL_MAX_BYTES]
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        k = rng.randrange(len(_PRINTABLE))
        t = short[rng.randrange(len(short))] + _PRINTABLE[k : k + 1]
        if t in have:
            continue
        have.add(t)
        out.append(t)
        if len(t) < FILL_MAX_BYTES:
            short.append(t)
    return out


def _merge(syms: list[int], a: int, b: int, new: int) -> list[int]:
    out: list[int] = []
    i, n = 0, len(syms)
    while i < n:
        if i + 1 < n and syms[i] == a and syms[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return out
