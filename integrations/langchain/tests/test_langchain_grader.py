"""`RagKVCacheGrader`: each retrieved document judged while reading its chunk's cache, as `RelevanceCheck` judges
it in the core; documents kept by the threshold, in order, with their relevance."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_rag_kvcache import RELEVANCE_KEY, RagKVCacheGrader, RagKVCacheRetriever

from rag_kvcache import Engine, RagKVCacheError
from rag_kvcache.relevance import RelevanceCheck

pytestmark = pytest.mark.smollm2  # the demo index built with SmolLM2-135M

QUESTION = "What is the main telescope of the Veldmark Observatory called?"


def test_the_grader_keeps_what_the_core_check_judges_relevant(demo_engine: Engine) -> None:
    docs = RagKVCacheRetriever(engine=demo_engine, k=4).invoke(QUESTION)
    every = RagKVCacheGrader(engine=demo_engine, threshold=0.0).invoke({"question": QUESTION, "documents": docs})
    assert [d.id for d in every] == [d.id for d in docs]
    index = demo_engine.index
    chunks = demo_engine.run(lambda: index.chunks.get([d.id for d in docs]))
    verdicts = demo_engine.run(lambda: RelevanceCheck(demo_engine.generator)(QUESTION, chunks))
    assert [d.metadata[RELEVANCE_KEY] for d in every] == pytest.approx([v.p_yes for v in verdicts], abs=1e-6)
    for v, c in zip(verdicts, chunks):  # the default index keeps every chunk's cache behind the prefix alone:
        assert index.addressing.own_context(c.token_ids) == index.format.prefix_ids  # so the chunk is read, exact,
        assert v.computed_tokens < 64  # and only the check question is computed
    threshold = sorted(v.p_yes for v in verdicts)[len(verdicts) // 2]
    kept = RagKVCacheGrader(engine=demo_engine, threshold=threshold).invoke({"question": QUESTION, "documents": docs})
    assert [d.id for d in kept] == [d.id for d, v in zip(docs, verdicts) if v.p_yes >= threshold]


def test_a_document_without_a_chunk_id_is_refused(demo_engine: Engine) -> None:
    with pytest.raises(RagKVCacheError, match="without a chunk id"):
        RagKVCacheGrader(engine=demo_engine).invoke({"question": QUESTION, "documents": [Document(page_content="x")]})
