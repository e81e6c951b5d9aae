"""Sentences of a prompt and the words they share with its question, read from token ids alone.

A chunk cached apart never saw the chunks before it in the prompt. Where two sentences in the prompt
say the same kind of thing about different subjects (two catalogue entries, two founders), full
prefill lets the later one attend to the earlier; its reused cache cannot, and the question's answer
then binds to the wrong one. `echo_sentences` finds those later sentences: every sentence after the
first in the prompt's chunks that shares enough words with the question. Where the question says it in
other words, `sentence_relevance` scores every sentence by meaning (an embedder's cosine similarity to the
question) and `closest_sentences` takes the best.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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


Embed = Callable[[list[str]], np.ndarray]  # texts -> [T, E] L2-normalised embeddings


def sentence_relevance(
    ids: torch.Tensor,
    lexicon: Lexicon,
    part: torch.Tensor,
    candidate: torch.Tensor,
    question: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    embed: Embed,
) -> torch.Tensor:
    """Each token's sentence's cosine similarity to the question [N], as `embed` reads both texts, for the
    sentences within `candidate` tokens (no longer than MAX_SENTENCE_TOKENS); -inf for every other token.
    One `embed` call for the question and every scored sentence. `ids`, `part` [N]: token ids and segment
    numbers; `candidate`, `question` [N] bool."""
    sentence = sentence_ids(lexicon.sentence_end[ids], part)  # [N]
    lengths = torch.bincount(sentence)  # [S]
    outside = torch.zeros_like(lengths).index_add_(0, sentence, (~candidate).long())  # [S], tokens not candidates
    scored = ((outside == 0) & (lengths <= MAX_SENTENCE_TOKENS)).nonzero()[:, 0]  # [S']
    relevance = torch.full(lengths.shape, -torch.inf, device=ids.device)  # [S]
    if scored.numel():
        words = torch.split(ids.cpu(), lengths.tolist())  # S tensors of token ids, the sentences in order
        asked = str(tokenizer.decode(ids[question].tolist(), skip_special_tokens=True))
        texts = [str(tokenizer.decode(words[s].tolist(), skip_special_tokens=True)) for s in scored.tolist()]
        vectors = embed([asked, *texts])  # [1 + S', E]
        cosine = torch.from_numpy(np.asarray(vectors[1:] @ vectors[0], dtype=np.float32))  # [S']
        relevance[scored] = cosine.to(ids.device)
    return relevance[sentence]  # [N]


def closest_sentences(relevance: torch.Tensor, sentence: torch.Tensor, n: int) -> torch.Tensor:
    """The tokens [N] of the `n` sentences of highest `relevance` ([N], each token its sentence's score, -inf:
    never chosen); `sentence` [N] numbers each token's sentence (`sentence_ids`)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    score = torch.full((int(sentence[-1]) + 1,), -torch.inf, device=relevance.device)  # [S]
    score = score.scatter_reduce(0, sentence, relevance, "amax")  # [S]
    best = score.topk(min(n, score.numel())).indices  # [n]
    chosen = torch.zeros_like(score, dtype=torch.bool).index_fill_(0, best, True) & score.isfinite()  # [S]
    return chosen[sentence]  # [N]
