"""`epic_match`: the sentences that echo the question, found from token ids, and what recomputing them buys."""

from __future__ import annotations

import pytest
import torch
from test_fusion import ATOL, chunk_kv

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.engine.sentences import MAX_SENTENCE_TOKENS, Lexicon, echo_sentences, sentence_ids

QUESTION = "which catalogue number does the registry list for alpha?"
FIRST = "the registry lists alpha under the catalogue number 41. the weather was fine that year."
SECOND = "the registry lists beta under the catalogue number 77."


def ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_lexicon_classes(tokenizer):
    lex = Lexicon.of(tokenizer)

    def flag(table: torch.Tensor, word: str) -> bool:
        return bool(table[tokenizer.convert_tokens_to_ids(word)])

    assert lex.sentence_end.shape == lex.word.shape == (len(tokenizer),)
    assert flag(lex.sentence_end, ".") and flag(lex.sentence_end, "?") and not flag(lex.sentence_end, ",")
    assert flag(lex.word, "registry") and flag(lex.word, "list")
    assert not flag(lex.word, "the") and not flag(lex.word, "which") and not flag(lex.word, "41")


def test_sentences_break_at_sentence_ends_and_segments():
    ends = torch.tensor([0, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    part = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert sentence_ids(ends, part).tolist() == [0, 0, 1, 1, 2, 2, 3]


def layout(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[range]]:
    """ids, segment numbers, chunk mask, question mask for chunks `texts` then the question; the chunks' spans."""
    runs = [ids(tokenizer, t) for t in texts] + [ids(tokenizer, QUESTION)]
    all_ids = torch.tensor([t for run in runs for t in run])
    part = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor([len(r) for r in runs]))
    spans, start = [], 0
    for run in runs:
        spans.append(range(start, start + len(run)))
        start += len(run)
    return all_ids, part, part < len(texts), part == len(texts), spans


def test_echo_is_every_matching_sentence_after_the_first(tokenizer):
    lex = Lexicon.of(tokenizer)
    all_ids, part, chunks, question, spans = layout(tokenizer, [FIRST, SECOND, SECOND])
    echoes = echo_sentences(all_ids, lex, part, chunks, question, min_shared=3)
    # the first chunk's first sentence is the first echo (kept as cached), its second sentence shares nothing;
    # both later chunks are one echoing sentence each
    assert echoes.nonzero()[:, 0].tolist() == [*spans[1], *spans[2]]
    assert not echo_sentences(all_ids, lex, part, chunks, question, min_shared=5).any()  # 4 shared words at most
    with pytest.raises(ValueError, match="min_shared must be >= 1, got 0"):
        echo_sentences(all_ids, lex, part, chunks, question, min_shared=0)


def test_a_run_too_long_for_a_sentence_never_echoes(tokenizer):
    lex = Lexicon.of(tokenizer)
    listing = "the registry lists beta under the catalogue number 77" + ", gamma" * 40 + "."
    all_ids, part, chunks, question, spans = layout(tokenizer, [FIRST, listing, SECOND])
    assert len(spans[1]) > MAX_SENTENCE_TOKENS
    echoes = echo_sentences(all_ids, lex, part, chunks, question, min_shared=3)
    assert echoes.nonzero()[:, 0].tolist() == list(spans[2])


def test_echo_ignores_text_outside_the_chunks(tokenizer):
    lex = Lexicon.of(tokenizer)
    all_ids, part, _, question, _ = layout(tokenizer, [SECOND, FIRST])
    only_second = part == 1  # the first chunk is not a chunk here (say, the system prompt)
    echoes = echo_sentences(all_ids, lex, part, only_second, question, min_shared=3)
    assert not echoes.any()  # FIRST's echo is now the first in the chunks; nothing after it echoes


def prompt(adapter, texts: list[str], question: str = QUESTION) -> FusionInput:
    """A prefix, the chunks `texts` cached behind the prefix alone, the question."""
    tok = adapter.tokenizer
    prefix = ids(tok, "answer from the documents.")
    segments = [
        Segment(prefix, True, "prefix"),
        *(Segment(ids(tok, t), True, f"chunk{i}") for i, t in enumerate(texts)),
        Segment(ids(tok, question), False, "question"),
    ]
    caches = [
        chunk_kv(adapter, s.ids, () if s.label == "prefix" else prefix) if s.cacheable else None for s in segments
    ]
    contexts = [() if s.label == "prefix" else prefix for s in segments]
    return FusionInput.build(segments, caches, contexts, device=adapter.device)


def fuse(adapter, inp: FusionInput, method: str, **cfg):
    return get_method(method)(adapter, inp, FusionConfig(method=method, **cfg))


def test_epic_match_recomputes_the_echoes_on_top_of_epic(tiny):
    inp = prompt(tiny, [FIRST, "nothing here is asked about.", SECOND])
    epic, match = fuse(tiny, inp, "epic", epic_k=2), fuse(tiny, inp, "epic_match", epic_k=2)
    echo = len(inp.parts[3].segment.ids) - 2  # the third chunk's one sentence, less the two heads EPIC computes
    assert [m - e for m, e in zip(match.active_per_layer, epic.active_per_layer)][:-1] == [echo] * 3


def test_epic_match_without_echoes_is_epic(tiny):
    inp = prompt(tiny, [FIRST, "nothing here is asked about.", "nor is anything here."])
    torch.testing.assert_close(
        fuse(tiny, inp, "epic_match", epic_k=3).logits, fuse(tiny, inp, "epic", epic_k=3).logits, atol=0, rtol=0
    )


def test_echoes_recomputed_whole_equal_full(tiny):
    # the chunk after the exact first one is one echoing sentence: recomputed whole, it is what full computes,
    # and so is everything after it
    inp = prompt(tiny, [FIRST, SECOND])
    match, full = fuse(tiny, inp, "epic_match", epic_k=0), fuse(tiny, inp, "full")
    assert fuse(tiny, inp, "epic", epic_k=0).logits.sub(full.logits).abs().max() > 100 * ATOL  # reuse is not exact here
    torch.testing.assert_close(match.logits, full.logits, atol=ATOL, rtol=0)
    for k, fk in zip(match.keys, full.keys):
        torch.testing.assert_close(k, fk, atol=ATOL, rtol=0)
