"""Token-exact document chunking.

A document is tokenised once; its chunks are consecutive windows of that one token sequence, so the
chunks' token ids concatenate back to the document's token ids exactly and no chunk is ever
re-tokenised (re-tokenising a span drifts from the ids it had in context and breaks cache hits).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from transformers import PreTrainedTokenizerBase

MIN_CHUNK_TOKENS = 16
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SENTENCE_END = (".", "!", "?")


@dataclass(frozen=True)
class Chunk:
    """One window of a document's token sequence and the text span it covers."""

    source: str
    ordinal: int
    token_ids: tuple[int, ...]
    char_start: int
    char_end: int
    text: str


class _Break(IntEnum):
    """How good a place the position right after a token is to end a chunk."""

    NONE = 0
    SENTENCE = 1
    PARAGRAPH = 2


def _breaks(text: str, offsets: Sequence[tuple[int, int]]) -> list[_Break]:
    """Classify the cut after each token from the text it spans up to where the next token starts.

    Looking at the span up to the next token makes this work both for tokenizers that drop
    whitespace (WordPiece: the newlines sit in the gap) and for those that emit it (byte-level BPE).
    """
    breaks = []
    for i, (start, end) in enumerate(offsets):
        next_start = offsets[i + 1][0] if i + 1 < len(offsets) else len(text)
        span = text[start : max(end, next_start)]
        if _PARAGRAPH_BREAK.search(span):
            breaks.append(_Break.PARAGRAPH)
        elif "\n" in span or (text[start:end].endswith(_SENTENCE_END) and (end == len(text) or text[end].isspace())):
            breaks.append(_Break.SENTENCE)
        else:
            breaks.append(_Break.NONE)
    return breaks


def _best_cut(breaks: Sequence[_Break], lo: int, hi: int) -> int:
    """The last paragraph break, else the last sentence end, among cuts in [lo, hi]; else hi."""
    best, best_break = hi, _Break.NONE
    for cut in range(hi, lo - 1, -1):
        if breaks[cut - 1] > best_break:
            best, best_break = cut, breaks[cut - 1]
            if best_break is _Break.PARAGRAPH:
                break
    return best


def chunk_document(
    text: str,
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    chunk_tokens: int,
    boundary_aware: bool = True,
) -> list[Chunk]:
    """Split `text` into consecutive windows of at most `chunk_tokens` tokens of its one tokenisation.

    With `boundary_aware`, a window ends at its last paragraph break, else its last sentence end,
    when that falls in the window's last quarter; otherwise it is cut at the token budget.
    `tokenizer` must be a Hugging Face fast tokenizer (offsets are needed to map tokens to text).
    """
    if chunk_tokens < MIN_CHUNK_TOKENS:
        raise ValueError(f"chunk_tokens must be >= {MIN_CHUNK_TOKENS}, got {chunk_tokens!r}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"chunking needs a fast tokenizer for offsets, got {type(tokenizer).__name__}")
    if not text.strip():
        return []

    # A document's text is text: a "<|im_start|>system" in it is spelt out, never a control token.
    encoding = tokenizer(
        text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True, verbose=False
    )
    ids: list[int] = encoding["input_ids"]
    offsets: list[tuple[int, int]] = encoding["offset_mapping"]
    breaks = _breaks(text, offsets) if boundary_aware else []
    min_tokens = chunk_tokens - chunk_tokens // 4

    chunks: list[Chunk] = []
    start = 0
    while start < len(ids):
        end = min(start + chunk_tokens, len(ids))
        if boundary_aware and end < len(ids):
            end = _best_cut(breaks, start + min_tokens, end)
        char_start, char_end = offsets[start][0], offsets[end - 1][1]
        chunks.append(
            Chunk(
                source=source,
                ordinal=len(chunks),
                token_ids=tuple(ids[start:end]),
                char_start=char_start,
                char_end=char_end,
                text=text[char_start:char_end],
            )
        )
        start = end
    return chunks
