"""Finding indexed chunks inside any prompt, by their token ids.

At indexing time every chunk contributes the hashes of its token n-grams at offsets 0, s, 2s, ...
(`NGRAM` tokens, stride `STRIDE`), each pointing back to (chunk, offset); the chunk index keeps them
in a table beside its chunks. At query time every n-gram of the prompt is hashed and looked up;
a hit is verified against the chunk's stored ids and extended left and right as far as the tokens
agree, and the longest extension wins. A span of at least `NGRAM + STRIDE - 1` tokens always
contains an indexed n-gram, so every such run of a chunk's ids in the prompt is found, whatever
surrounds it: a chunk quoted whole, cut short, repeated, or with its edges re-tokenised differently
by the text around it (those edge tokens differ, so they fall outside the span and are computed).

Matching is exact on token ids: a span's ids equal the chunk's ids at its offset, token for token.
The work is linear in the prompt length: each prompt position is hashed once, looked up once, and
after a span is taken the scan resumes at its end; candidates per n-gram are capped.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

NGRAM = 8  # tokens hashed per table entry
STRIDE = 8  # a chunk's n-grams are indexed at offsets 0, STRIDE, 2*STRIDE, ...
MIN_SPAN = 16  # shorter runs are not worth a cache read: computed
MAX_CANDIDATES = 16  # chunks tried per prompt n-gram (a very common n-gram is not worth more)


@dataclass(frozen=True)
class Span:
    """Prompt tokens [start, start + length) equal the ids of chunk `chunk` at [offset, offset + length)."""

    start: int
    chunk: Hashable
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def ngram_hash(ids: Sequence[int]) -> int:
    """A 63-bit hash of token ids (non-negative, so it fits SQLite's signed INTEGER)."""
    return xxhash.xxh3_64_intdigest(np.asarray(ids, dtype="<i4").tobytes()) >> 1


def chunk_ngrams(ids: Sequence[int], n: int = NGRAM, stride: int = STRIDE) -> Iterator[tuple[int, int]]:
    """(hash, offset) of a chunk's n-grams at offsets 0, stride, 2*stride, ... (the table's entries)."""
    for offset in range(0, len(ids) - n + 1, stride):
        yield ngram_hash(ids[offset : offset + n]), offset


def prompt_ngrams(ids: Sequence[int], n: int = NGRAM) -> list[int]:
    """The hash of the n-gram starting at every prompt position (len(ids) - n + 1 of them)."""
    packed = np.asarray(ids, dtype="<i4")  # [T]
    if len(packed) < n:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(packed, n)  # [T - n + 1, n]
    return [xxhash.xxh3_64_intdigest(w.tobytes()) >> 1 for w in windows]


def find_spans(
    prompt: Sequence[int],
    candidates: Mapping[int, Sequence[tuple[Hashable, int]]],
    chunk_ids: Mapping[Hashable, Sequence[int]],
    n: int = NGRAM,
    min_span: int = MIN_SPAN,
) -> list[Span]:
    """Non-overlapping spans of `prompt` that equal runs of indexed chunks, in prompt order.

    `candidates` maps an n-gram hash to the (chunk, offset) entries the index holds for it (hashes it
    lacks have none); `chunk_ids` gives each candidate chunk's stored ids. Scanning left to right,
    the first position whose n-gram verifies against a chunk takes the longest run through it
    (extended left back to the previous span's end); runs shorter than `min_span` are dropped.
    """
    if min_span < n:
        raise ValueError(f"min_span ({min_span}) must be at least the n-gram length ({n})")
    hashes = prompt_ngrams(prompt, n)
    spans: list[Span] = []
    taken = i = 0  # prompt tokens before `taken` belong to spans already chosen
    while i < len(hashes):
        best: Span | None = None
        for chunk, offset in candidates.get(hashes[i], ())[:MAX_CANDIDATES]:
            span = _extend(prompt, i, chunk, offset, chunk_ids[chunk], taken)
            if span is not None and (best is None or (span.end, span.length) > (best.end, best.length)):
                best = span
        if best is not None and best.length >= min_span:
            spans.append(best)
            taken = i = best.end
        else:
            i += 1
    return spans


def _extend(prompt: Sequence[int], i: int, chunk: Hashable, offset: int, ids: Sequence[int], floor: int) -> Span | None:
    """The longest run of `prompt` through position i equal to `ids` aligned at `offset` (None when
    the n-gram at i was a hash collision); it starts no earlier than prompt position `floor`."""
    lo, hi = i, i
    while hi < len(prompt) and offset + hi - i < len(ids) and prompt[hi] == ids[offset + hi - i]:
        hi += 1
    if hi == i:
        return None
    while lo > floor and offset + lo - i > 0 and prompt[lo - 1] == ids[offset + lo - i - 1]:
        lo -= 1
    return Span(lo, chunk, offset + lo - i, hi - lo)
