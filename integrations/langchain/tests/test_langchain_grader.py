"""`RagKVCacheGrader`: each retrieved document judged while reading its chunk's cache, as `RelevanceCheck` judges
it in the core; documents kept by the threshold, in order, with their relevance; a document whose text is not its
chunk's judged on its own text; the question and documents bounded."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_rag_kvcache import RELEVANCE_KEY, RagKVCacheGrader, RagKVCacheRetriever

from rag_kvcache import RagKVCacheError, RelevanceCheck, ServingEngine

from ...testing import QUESTION

pytestmark = pytest.mark.smollm2  # the demo index built with SmolLM2-135M


def test_the_grader_keeps_what_the_core_check_judges_relevant(demo_engine: ServingEngine) -> None:
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


def test_a_foreign_text_under_a_real_chunk_id_is_graded_on_its_own_text(demo_engine: ServingEngine) -> None:
    """A Document of other text carrying a real chunk id got that chunk's relevance ("Banana bread..." kept with
    the telescope chunk's 0.2326), the grader reading the chunk's cache, not the text it was given. Now a chunk's
    cache is read only when the Document's text is that chunk's; another text is computed, and graded as itself."""
    real = RagKVCacheRetriever(engine=demo_engine, k=1).invoke(QUESTION)[0]
    foreign = real.model_copy(update={"page_content": "Banana bread is baked from ripe bananas, flour and butter."})
    loose = Document(page_content=foreign.page_content)  # no chunk id: graded too, computed
    graded = RagKVCacheGrader(engine=demo_engine, threshold=0.0).invoke(
        {"question": QUESTION, "documents": [real, foreign, loose]}
    )
    p_real, p_foreign, p_loose = (d.metadata[RELEVANCE_KEY] for d in graded)
    check = RelevanceCheck(demo_engine.generator)
    (banana,) = demo_engine.run(lambda: check(QUESTION, [foreign.page_content]))
    (chunk,) = demo_engine.run(lambda: check(QUESTION, demo_engine.index.chunks.get([real.id])))
    assert p_real == pytest.approx(chunk.p_yes, abs=1e-6)
    assert p_foreign == pytest.approx(banana.p_yes, abs=1e-4)  # computed in a batch of two: float noise
    assert p_loose == pytest.approx(p_foreign, abs=1e-4) and abs(p_foreign - p_real) > 1e-3
    assert banana.computed_tokens > chunk.computed_tokens  # the text computed with the question


def test_an_over_long_question_or_too_many_documents_is_refused_naming_the_limit(demo_engine: ServingEngine) -> None:
    """A 200,000-character question was computed whole, and OOM-killed at 17-18 GB. The grader's question and
    documents are bounded as the server's requests are: a ValueError naming the limit, nothing computed."""
    docs = RagKVCacheRetriever(engine=demo_engine, k=2).invoke(QUESTION)
    grader = RagKVCacheGrader(engine=demo_engine)
    with pytest.raises(ValueError, match=r"the question makes a check prompt of \d+ tokens, over the limit of 8192"):
        grader.invoke({"question": "telescope " * 20_000, "documents": docs})
    with pytest.raises(ValueError, match=r"passage 1 with the question .* over the limit of 8192"):
        grader.invoke({"question": QUESTION, "documents": [docs[0], Document(page_content="lens " * 9_000)]})
    with pytest.raises(ValueError, match="65 documents to grade, over the limit of 64"):
        grader.invoke({"question": QUESTION, "documents": docs[:1] * 65})
    with pytest.raises(RagKVCacheError, match="over the limit of 100 tokens"):
        RagKVCacheGrader(engine=demo_engine, max_prompt_tokens=100).invoke(
            {"question": QUESTION, "documents": [Document(page_content=docs[0].page_content * 2)]}
        )
