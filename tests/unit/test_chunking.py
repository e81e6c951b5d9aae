"""Token-exact chunking with the real (fast) all-MiniLM-L6-v2 tokenizer (`tokenizer` fixture, conftest)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from transformers import PreTrainedTokenizerBase

from rag_kvcache.retrieval.chunking import Chunk, chunk_document

PARAGRAPH = (
    "Retrieval-augmented generation prepends retrieved passages to a question. "
    "Prefilling those passages dominates the time to first token! "
    "Caching each chunk's keys and values avoids recomputing them for every query? "
    "Version 3.14 of the format stores 512-token chunks, e.g. for long manuals.\n"
    "A single newline also ends a line of text without a full stop\n"
)
DOCUMENT = "\n\n".join(PARAGRAPH for _ in range(6))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoding["input_ids"], encoding["offset_mapping"]


@pytest.mark.parametrize("boundary_aware", [True, False])
@pytest.mark.parametrize("chunk_tokens", [16, 37, 128])
def test_chunks_concatenate_to_the_document_tokens_within_budget(
    tokenizer: PreTrainedTokenizerBase, chunk_tokens: int, boundary_aware: bool
) -> None:
    ids, _ = _encode(tokenizer, DOCUMENT)
    chunks = chunk_document(DOCUMENT, "doc.txt", tokenizer, chunk_tokens, boundary_aware=boundary_aware)

    assert [token for chunk in chunks for token in chunk.token_ids] == ids
    assert [chunk.ordinal for chunk in chunks] == list(range(len(chunks)))
    assert all(chunk.source == "doc.txt" for chunk in chunks)
    assert all(1 <= len(chunk.token_ids) <= chunk_tokens for chunk in chunks)
    min_tokens = chunk_tokens if not boundary_aware else chunk_tokens - chunk_tokens // 4
    assert all(len(chunk.token_ids) >= min_tokens for chunk in chunks[:-1])


def test_chunk_text_spans_match_token_offsets(tokenizer: PreTrainedTokenizerBase) -> None:
    _, offsets = _encode(tokenizer, DOCUMENT)
    chunks = chunk_document(DOCUMENT, "doc.txt", tokenizer, 32)

    first = 0
    for chunk in chunks:
        last = first + len(chunk.token_ids) - 1
        assert (chunk.char_start, chunk.char_end) == (offsets[first][0], offsets[last][1])
        assert chunk.text == DOCUMENT[chunk.char_start : chunk.char_end]
        first = last + 1
    assert all(chunk.char_end <= following.char_start for chunk, following in pairwise(chunks))


def _words(n: int) -> str:
    """`n` single-token words."""
    return " ".join(["word"] * n)


@pytest.mark.parametrize(
    ("text", "first_chunk_len", "why"),
    [
        (
            _words(11) + ".\n\n" + _words(1) + ". " + _words(20),
            12,
            "last paragraph break beats a later sentence end",
        ),
        (_words(11) + ". " + _words(2) + ". " + _words(20), 15, "last sentence end in the last quarter"),
        (_words(13) + "\n" + _words(20), 13, "a newline ends a sentence"),
        (_words(7) + ". " + _words(20), 16, "sentence end before the last quarter: cut at the budget"),
        (_words(12) + " 3.14 " + _words(20), 16, "a decimal point is not a sentence end"),
    ],
)
def test_boundary_aware_cuts(tokenizer: PreTrainedTokenizerBase, text: str, first_chunk_len: int, why: str) -> None:
    assert all(len(tokenizer.tokenize(word)) == 1 for word in ("word", ".", "3", "14")), "test premise"
    chunks = chunk_document(text, "doc.txt", tokenizer, 16)
    assert len(chunks[0].token_ids) == first_chunk_len, why
    assert len(chunk_document(text, "doc.txt", tokenizer, 16, boundary_aware=False)[0].token_ids) == 16


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \n"])
def test_empty_or_whitespace_text_has_no_chunks(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    assert chunk_document(text, "doc.txt", tokenizer, 128) == []


def test_short_text_is_one_chunk(tokenizer: PreTrainedTokenizerBase) -> None:
    [chunk] = chunk_document("  Hello there.  ", "a/b.md", tokenizer, 128)
    assert chunk == Chunk("a/b.md", 0, tuple(_encode(tokenizer, "Hello there.")[0]), 2, 14, "Hello there.")


@pytest.mark.parametrize("chunk_tokens", [15, 0, -128])
def test_rejects_too_small_chunk_tokens(tokenizer: PreTrainedTokenizerBase, chunk_tokens: int) -> None:
    with pytest.raises(ValueError, match=f"got {chunk_tokens}"):
        chunk_document(DOCUMENT, "doc.txt", tokenizer, chunk_tokens)


def test_rejects_tokenizer_without_offsets() -> None:
    with pytest.raises(TypeError, match="fast tokenizer"):
        chunk_document(DOCUMENT, "doc.txt", object(), 128)
