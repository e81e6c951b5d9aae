"""Finding indexed chunks in any prompt by token ids (`retrieval.matching`), on synthetic ids and on
text re-tokenised inside a prompt by a real tokenizer."""

from __future__ import annotations

import random

import pytest

from rag_kvcache.retrieval.matching import MIN_SPAN, NGRAM, Span, chunk_ngrams, find_spans, prompt_ngrams


def _table(chunks: dict[str, tuple[int, ...]]) -> dict[int, list[tuple[str, int]]]:
    """What the chunk index stores: n-gram hash -> (chunk, offset)."""
    table: dict[int, list[tuple[str, int]]] = {}
    for name, ids in chunks.items():
        for h, offset in chunk_ngrams(ids):
            table.setdefault(h, []).append((name, offset))
    return table


def _match(prompt, chunks, **kw) -> list[Span]:
    spans = find_spans(prompt, _table(chunks), chunks, **kw)
    for s in spans:  # exact on token ids, always
        assert tuple(prompt[s.start : s.end]) == chunks[s.chunk][s.offset : s.offset + s.length]
    return spans


@pytest.fixture
def chunks() -> dict[str, tuple[int, ...]]:
    rng = random.Random(0)
    return {name: tuple(rng.randrange(1000, 30000) for _ in range(64)) for name in "abc"}


def noise(n: int, seed: int = 1) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 999) for _ in range(n))  # never a chunk token


@pytest.mark.parametrize("offset", [0, 1, 7, 33, 200])
def test_whole_chunk_at_any_offset(chunks, offset):
    prompt = noise(offset) + chunks["b"] + noise(5, 2)
    assert _match(prompt, chunks) == [Span(offset, "b", 0, 64)]


def test_partial_chunks_cut_anywhere(chunks):
    prompt = noise(3) + chunks["a"][13:50] + noise(4, 2) + chunks["c"][:20] + noise(2, 3) + chunks["b"][45:]
    assert _match(prompt, chunks) == [Span(3, "a", 13, 37), Span(44, "c", 0, 20), Span(66, "b", 45, 19)]


def test_short_runs_are_computed(chunks):
    prompt = noise(3) + chunks["a"][10 : 10 + MIN_SPAN - 1] + noise(3, 2)
    assert _match(prompt, chunks) == []
    assert _match(prompt, chunks, min_span=NGRAM) == [Span(3, "a", 10, MIN_SPAN - 1)]


def test_chunk_quoted_twice_and_chunks_back_to_back(chunks):
    prompt = chunks["a"] + chunks["b"] + noise(9) + chunks["a"] + noise(1)
    assert _match(prompt, chunks) == [Span(0, "a", 0, 64), Span(64, "b", 0, 64), Span(137, "a", 0, 64)]


def test_overlapping_chunks(chunks):
    """Chunks cut from one text with overlap (a splitter's chunk_overlap): the text once in the prompt
    is covered by the first chunk whole and the rest of the second, without overlap."""
    text = noise(100, 7)
    overlapping = {"first": text[:60], "second": text[40:]}
    prompt = noise(5) + text + noise(5, 2)
    assert _match(prompt, overlapping) == [Span(5, "first", 0, 60), Span(65, "second", 20, 40)]


def test_near_miss_is_not_reused(chunks):
    """One token changed in the middle of a chunk: two exact spans around it; the changed token and
    its neighbours in no span are computed."""
    changed = list(chunks["a"])
    changed[32] = 5
    spans = _match(noise(2) + tuple(changed) + noise(2, 2), chunks)
    assert spans == [Span(2, "a", 0, 32), Span(35, "a", 33, 31)]


def test_hash_collisions_are_verified(chunks):
    """A table entry pointing at the wrong chunk (as a hash collision would) matches nothing."""
    table = {h: [("c", offset)] for h, offset in chunk_ngrams(chunks["a"])}
    assert find_spans(noise(4) + chunks["a"], table, chunks) == []


def test_prompt_shorter_than_an_ngram(chunks):
    assert prompt_ngrams(chunks["a"][:3]) == [] and _match(chunks["a"][:3], chunks) == []


def test_chunk_text_retokenised_inside_a_prompt(tokenizer):
    """A chunk's text quoted in a prompt is tokenised with its neighbours: the edges may merge with
    them, the rest matches the stored ids exactly."""
    text = "Mount Etna in Sicily is one of the most active volcanoes on Earth, erupting lava almost every year."
    stored = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    for before, after in [("Context:", "\n\nQuestion: what?"), ("x-", "-y"), ("<doc>", "</doc>")]:
        prompt = tuple(tokenizer(f"{before}{text}{after}", add_special_tokens=False).input_ids)
        [span] = _match(prompt, {"etna": stored})
        assert span.length >= len(stored) - 2, (before, after, span)
