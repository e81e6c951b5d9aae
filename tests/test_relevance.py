"""Relevance checks that read the chunk caches (`rag_kvcache.relevance`): only the check's question is computed,
and the verdict is what a full prefill of the same check prompt gives."""

from __future__ import annotations

import pytest
import torch
from test_faults import CFG, QUESTION, write_docs

from rag_kvcache.config import FusionConfig
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.generator import FusedGenerator
from rag_kvcache.index import KVIndex
from rag_kvcache.relevance import CHECK, RelevanceCheck


@pytest.fixture(scope="module")
def generator(tiny, tmp_path_factory) -> FusedGenerator:
    root = tmp_path_factory.mktemp("relevance")
    return FusedGenerator(KVIndex.build(write_docs(root / "docs", 3), root / "index", CFG, adapter=tiny, progress=False))


def test_a_check_computes_only_its_question_and_equals_a_full_prefill(generator):
    index = generator.index
    chunks = [hit.chunk for hit in index.search(QUESTION, 3)]
    check = RelevanceCheck(generator)
    verdicts = check(QUESTION, chunks)
    question = index.format.question_ids(index.adapter.tokenizer, CHECK.format(question=QUESTION))
    assert [v.chunk for v in verdicts] == chunks
    for verdict, chunk in zip(verdicts, chunks):
        assert verdict.computed_tokens == len(question)  # the prefix and the chunk read from their caches
        logits = generator.fuse(index.format.segments([chunk.token_ids], question), FusionConfig(method="full")).result.logits
        p = torch.softmax(logits.float(), dim=-1)  # [V]
        want = float(p[check.yes].sum() / (p[check.yes].sum() + p[check.no].sum()))
        assert verdict.p_yes == pytest.approx(want, abs=1e-4)
        assert verdict.relevant == (verdict.p_yes >= 0.5)


@pytest.mark.parametrize("template,threshold,message", [
    ("Is it relevant?", 0.5, "must contain '{question}'"), (CHECK, 1.5, "threshold must be in"),
])
def test_a_bad_check_is_refused(generator, template, threshold, message):
    with pytest.raises(RagKVCacheError, match=message):
        RelevanceCheck(generator, template, threshold)
