"""`epic_evidence`: the sentences of a prompt's chunks closest in meaning to its question, scored by the index's
embedder, and what recomputing them buys; found where the question shares no word with its evidence."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch
from test_fusion import ATOL
from test_sentences import fuse, ids, prompt

from rag_kvcache.config import (
    Config,
    ConfigError,
    FusionConfig,
    GenerationConfig,
    IndexSettings,
    QueryConfig,
    RuntimeConfig,
    StorageConfig,
)
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.sentences import Lexicon, closest_sentences, sentence_ids, sentence_relevance
from rag_kvcache.generator import FusedGenerator
from rag_kvcache.index import KVIndex
from rag_kvcache.retrieval.embedder import load_embedder, unit_vectors

FACT = "the society devoted to alpha was founded by maro dent. the weather was fine that year."
OTHER = "the registry lists beta under the catalogue number 77."
PARAPHRASE = "who started the association dedicated to alpha?"  # no word of FACT's but the subject's


@pytest.fixture(scope="module")
def embed():
    return partial(unit_vectors, load_embedder())  # unit vectors, as `ChunkIndex.embed` makes them


def test_closest_sentences_are_the_highest_scored_never_an_unscored_one():
    sentence = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    relevance = torch.tensor([0.2, 0.2, 0.9, 0.9, 0.9, -math.inf, 0.5, 0.5])
    assert closest_sentences(relevance, sentence, 1).nonzero()[:, 0].tolist() == [2, 3, 4]
    assert closest_sentences(relevance, sentence, 2).nonzero()[:, 0].tolist() == [2, 3, 4, 6, 7]
    assert closest_sentences(relevance, sentence, 9).nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4, 6, 7]  # not 5
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        closest_sentences(relevance, sentence, 0)


def test_the_paraphrased_evidence_scores_highest(tokenizer, embed):
    lex = Lexicon.of(tokenizer)
    runs = [ids(tokenizer, t) for t in (OTHER, FACT, OTHER)] + [ids(tokenizer, PARAPHRASE)]
    all_ids = torch.tensor([t for run in runs for t in run])
    part = torch.repeat_interleave(torch.arange(4), torch.tensor([len(r) for r in runs]))
    candidate, question = (part == 1) | (part == 2), part == 3  # the first chunk is not a candidate
    relevance = sentence_relevance(all_ids, lex, part, candidate, question, tokenizer, embed)  # [N]
    sentence = sentence_ids(lex.sentence_end[all_ids], part)
    assert relevance[~candidate].isinf().all()  # neither the first chunk nor the question is scored
    founded = (part == 1) & (sentence == sentence[part == 1][0])  # FACT's first sentence
    assert closest_sentences(relevance, sentence, 1).equal(founded)
    assert relevance[founded][0] > relevance[(part == 1) & ~founded][0] > -math.inf


def scored(adapter, texts: list[str], embed) -> FusionInput:
    """`prompt` of `texts` asked PARAPHRASE, its reusable sentences scored by `embed`, as the generator scores them."""
    inp = prompt(adapter, texts, PARAPHRASE)
    question = inp.token_mask(lambda p: p is inp.parts[-1])
    return FusionInput(
        inp.ids,
        inp.parts,
        sentence_relevance(inp.ids, adapter.lexicon, inp.segment_of, inp.reusable, question, adapter.tokenizer, embed),
    )


def test_epic_evidence_recomputes_the_closest_sentence_on_top_of_epic(tiny, tokenizer, embed):
    inp = scored(tiny, [OTHER, FACT, OTHER], embed)
    epic, evidence = fuse(tiny, inp, "epic", epic_k=2), fuse(tiny, inp, "epic_evidence", epic_k=2, evidence_sentences=1)
    founded = len(ids(tokenizer, FACT.split(". ")[0] + ".")) - 2  # its first sentence, less the two heads EPIC computes
    assert [e - p for e, p in zip(evidence.active_per_layer, epic.active_per_layer)][:-1] == [founded] * 3


def test_the_evidence_recomputed_whole_equals_full(tiny, tokenizer, embed):
    # the chunk after the exact first one is one sentence, the closest: recomputed whole, it is what full computes
    inp = scored(tiny, [OTHER, FACT.split(". ")[0] + "."], embed)
    evidence, full = fuse(tiny, inp, "epic_evidence", epic_k=0, evidence_sentences=1), fuse(tiny, inp, "full")
    assert fuse(tiny, inp, "epic", epic_k=0).logits.sub(full.logits).abs().max() > 100 * ATOL  # reuse is not exact
    torch.testing.assert_close(evidence.logits, full.logits, atol=ATOL, rtol=0)
    for k, fk in zip(evidence.keys, full.keys):
        torch.testing.assert_close(k, fk, atol=ATOL, rtol=0)


def test_without_relevance_epic_evidence_refuses(tiny):
    with pytest.raises(ValueError, match="epic_evidence reads each sentence's relevance"):
        fuse(tiny, prompt(tiny, [OTHER, FACT]), "epic_evidence")
    with pytest.raises(ConfigError, match="evidence_sentences must be >= 1, got 0"):
        FusionConfig(evidence_sentences=0)


def test_the_generator_scores_the_sentences_with_the_index_embedder(tiny, tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(OTHER + " " + FACT)
    (docs / "b.txt").write_text("Saltmere is a mill village on the river Anvel, known for its caraway bread.")
    cfg = Config(
        index=IndexSettings(chunk_tokens=24, chunk_prefill="behind_prefix"),  # no chunk exact: each has its repair
        query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=4)),
        runtime=RuntimeConfig(storage=StorageConfig(memory_bytes=0)),
    )
    index = KVIndex.build(docs, tmp_path / "idx", cfg, adapter=tiny, progress=False)
    gen = FusedGenerator(index)
    segments = index.format.segments(
        [h.chunk.token_ids for h in index.search(PARAPHRASE, 3)], index.format.question_ids(tiny.tokenizer, PARAPHRASE)
    )
    fused = gen.fuse(segments, FusionConfig(method="epic_evidence", epic_k=0, evidence_sentences=1))
    epic = gen.fuse(segments, FusionConfig(method="epic", epic_k=0))
    assert "evidence" in fused.result.stages and "evidence" not in epic.result.stages
    assert 0 < fused.result.recomputed_tokens - epic.result.recomputed_tokens <= 24  # one sentence of a chunk
    answer = gen.ask(PARAPHRASE, fusion=FusionConfig(method="epic_evidence"))
    assert answer.method == "epic_evidence" and answer.recomputed_tokens > 0
