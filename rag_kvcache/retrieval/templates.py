"""Learning the recurring text of a pipeline's prompt template, so it is read from a cache like a chunk.

A pipeline's template puts its own text around the chunks it quotes: LlamaIndex's default text-QA
template follows them with "---------------------\\nGiven the context information and not prior
knowledge, answer the query.\\nQuery: {query_str}\\nAnswer: ". That text recurs in every prompt the
pipeline sends; the question does not. `TemplateSpans` learns it from the prompts themselves, per
head (the prompt's tokens before its first chunk, which tell one pipeline's prompts from
another's): the tail after the last chunk of each prompt is kept (a few per head) with the chunks
the prompt quoted, and the longest run of tokens a new tail shares with a kept tail *over other
chunks*, when at least `min_span` long, becomes a template span. Prompts over the same chunks teach
nothing: they are most often the same question asked again (a retry, a structured-output variant
with other format instructions), and what their tails share is that question. Over other chunks
the question is another one, and what two tails share is the template's text, and words their
questions share only until a question without them comes: a span shrinks to what a later tail
still shares with it (say "What is" in two questions: the third, "Who ...", cuts the span back to
the template's text).

Spans are found in later tails as chunks are found in prompts (`matching.find_spans`: exact on token
ids, partial runs of at least `min_span` tokens included, a near-miss computed). Memory is bounded:
`max_heads` heads (least recently seen dropped), `MAX_TAILS` tails of at most `MAX_TAIL` tokens and
`MAX_SPANS` spans each.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from .matching import MIN_SPAN, Span, chunk_ngrams, find_spans

MAX_TAILS = 4  # distinct recent tails kept per head
MAX_SPANS = 4  # template spans kept per head (a pipeline may send several templates behind one head)
MAX_HEADS = 64  # heads remembered (least recently seen dropped)
MAX_TAIL = 512  # a tail's first tokens learned from (bounds the memory and the comparison's cost)


@dataclass
class _Learned:
    tails: deque[tuple[Hashable, tuple[int, ...]]] = field(default_factory=lambda: deque(maxlen=MAX_TAILS))
    spans: list[tuple[int, ...]] = field(default_factory=list)


class TemplateSpans:
    """Template spans learned from the tails of prompts, per head (see the module's docstring)."""

    def __init__(self, min_span: int = MIN_SPAN, max_heads: int = MAX_HEADS) -> None:
        if min_span < 1 or max_heads < 1:
            raise ValueError(f"min_span and max_heads must be >= 1, got {min_span!r} and {max_heads!r}")
        self.min_span = min_span
        self.max_heads = max_heads
        self._heads: OrderedDict[tuple[int, ...], _Learned] = OrderedDict()

    def spans(self, head: Sequence[int]) -> list[tuple[int, ...]]:
        """The template spans learned behind `head`."""
        learned = self._heads.get(tuple(head))
        return [] if learned is None else list(learned.spans)

    def learn(self, head: Sequence[int], chunks: Hashable, tail: Sequence[int]) -> list[tuple[int, ...]]:
        """Learn from a prompt's `tail` (its tokens after the last chunk) behind `head`, the prompt
        quoting `chunks` (any key that is equal for prompts over the same chunks); returns the spans
        made or shrunk by it (their caches are not stored yet)."""
        head, tail = tuple(head), tuple(tail[:MAX_TAIL])
        learned = self._heads.pop(head, None) or _Learned()
        self._heads[head] = learned  # most recently seen last
        while len(self._heads) > self.max_heads:
            self._heads.popitem(last=False)
        new: list[tuple[int, ...]] = []
        for quoted, seen in reversed(learned.tails):
            if quoted == chunks:  # the same chunks: most often the same question again
                continue
            match = SequenceMatcher(None, seen, tail, autojunk=False).find_longest_match(0, len(seen), 0, len(tail))
            if match.size >= self.min_span and (span := _place(learned.spans, tail[match.b : match.b + match.size])):
                new.append(span)
        if (chunks, tail) not in learned.tails:
            learned.tails.append((chunks, tail))
        return new

    def find(self, head: Sequence[int], ids: Sequence[int]) -> list[Span]:
        """Runs of `ids` (a prompt's tail) equal to the spans learned behind `head` (`Span.chunk`: the
        span's ids), in order, not overlapping; offsets are into `ids`."""
        spans = self.spans(head)
        if not spans:
            return []
        candidates: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for span in spans:
            for h, offset in chunk_ngrams(span):
                candidates.setdefault(h, []).append((span, offset))
        return find_spans(ids, candidates, {span: span for span in spans}, min_span=self.min_span)


def _place(spans: list[tuple[int, ...]], found: tuple[int, ...]) -> tuple[int, ...] | None:
    """Put a run two tails share among `spans`: it replaces a span it is part of (that span held text
    this tail does not share), is dropped when it holds a span (the span is what more prompts share) or
    equals one, and is added otherwise (the oldest span dropped past `MAX_SPANS`); returns it if placed."""
    for i, span in enumerate(spans):
        if _contains(found, span):
            return None
        if _contains(span, found):
            spans[i] = found
            return found
    spans.append(found)
    del spans[:-MAX_SPANS]
    return found


def _contains(outer: tuple[int, ...], inner: tuple[int, ...]) -> bool:
    """Whether `inner` is a contiguous run of `outer`."""
    n = len(inner)
    return any(tuple(outer[i : i + n]) == tuple(inner) for i in range(len(outer) - n + 1))
