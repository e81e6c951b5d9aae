"""Sentences of a prompt and the words they share with its question, read from token ids alone.

A chunk cached apart never saw the chunks before it in the prompt. Where two sentences in the prompt
say the same kind of thing about different subjects (two catalogue entries, two founders), full
prefill lets the later one attend to the earlier; its reused cache cannot, and the question's answer
then binds to the wrong one. `echo_sentences` finds those later sentences: every sentence after the
first in the prompt's chunks that shares enough words with the question.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

MIN_WORD_LETTERS = 4  # shorter tokens are mostly function words and word pieces
MAX_SENTENCE_TOKENS = 64  # a longer run without a sentence end is a list or a table, not one statement
STOP_WORDS = frozenset(
    {
        "about",
        "after",
        "also",
        "been",
        "before",
        "does",
        "from",
        "have",
        "into",
        "many",
        "much",
        "only",
        "over",
        "some",
        "such",
        "than",
        "that",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "under",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "whom",
        "whose",
        "will",
        "with",
        "would",
    }
)


@dataclass(frozen=True)
class Lexicon:
    """Two word classes over a tokenizer's vocabulary, one flag per token id."""

    sentence_end: torch.Tensor  # [V] bool: the token ends a sentence (".", "!", "?") or holds a line break
    word: torch.Tensor  # [V] bool: the token is a whole word of MIN_WORD_LETTERS+ letters, not a stop word

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerFast, device: torch.device | str = "cpu") -> Lexicon:
        # one decode per id in the Rust backend, in parallel: ~1 s for a 49k vocabulary (batch_decode: ~5x that)
        texts = tokenizer.backend_tokenizer.decode_batch(
            [[i] for i in range(len(tokenizer))], skip_special_tokens=False
        )
        ends = [t.rstrip(" ").endswith((".", "!", "?")) or "\n" in t for t in texts]
        bare = [t.strip().lower() for t in texts]
        words = [w.isalpha() and len(w) >= MIN_WORD_LETTERS and w not in STOP_WORDS for w in bare]
        return cls(torch.tensor(ends, device=device), torch.tensor(words, device=device))


def sentence_ids(ends: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Number each token's sentence [N]: a sentence ends after a sentence-ending token (`ends` [N]) and at
    every segment boundary (`part` [N], the segment each token belongs to)."""
    starts = torch.ones_like(ends)  # [N]
    starts[1:] = ends[:-1] | (part[1:] != part[:-1])  # [N-1]
    return starts.long().cumsum(0) - 1  # [N]


def echo_sentences(
    ids: torch.Tensor,
    lexicon: Lexicon,
    part: torch.Tensor,
    cached: torch.Tensor,
    question: torch.Tensor,
    min_shared: int,
) -> torch.Tensor:
    """The tokens [N] of every sentence in the cached segments that shares at least `min_shared` distinct
    words with the question, except the first such sentence of the prompt (it has nothing before it to
    attend to); a sentence longer than MAX_SENTENCE_TOKENS never echoes. `ids`, `part` [N]: token ids and
    segment numbers; `cached`, `question` [N] bool."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared!r}")
    sentence = sentence_ids(lexicon.sentence_end[ids], part)  # [N]
    asked = torch.unique(ids[question & lexicon.word[ids]])  # [Q]
    shares = (ids[:, None] == asked[None, :]) & cached[:, None]  # [N, Q]
    n_sentences = int(sentence[-1]) + 1
    counts = torch.zeros(n_sentences, asked.numel(), device=ids.device)  # [S, Q]
    present = counts.index_add_(0, sentence, shares.float()) > 0  # [S, Q]
    echoes = (present.sum(1) >= min_shared) & (torch.bincount(sentence) <= MAX_SENTENCE_TOKENS)  # [S]
    echoes[echoes.nonzero()[:1, 0]] = False  # the first one stays as cached
    return echoes[sentence] & cached  # [N]
