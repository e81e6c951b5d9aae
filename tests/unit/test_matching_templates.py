"""A prompt template's recurring text after the chunks (LlamaIndex's default text-QA template's, say) is
learned from the prompts and read from a cache from the second prompt on, exact on token ids, on the
tiny Llama; the question (what differs between prompts) and a near-miss are computed, ratio 1.0 still
equals `full`, and a corrupt template cache is recomputed with the answer unchanged. Off by default
(`FusionConfig.template_text`): the indexes here turn it on."""

from __future__ import annotations

import logging

import pytest
import torch
from test_matching_prompt import CFG, DOCS

from rag_kvcache.config import FusionConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.templates import TemplateSpans, _contains

HEAD = "You are an expert Q&A system that is trusted around the world. Always answer the query using the context.\n"
TAIL = (
    "\n---------------------\nGiven the context information and not prior knowledge, answer the query.\n"
    "Query: {q}\nAnswer:"
)
QUESTIONS = ("who ground the lens of the telescope?", "when was the lighthouse lit?", "what did the keeper keep?")


@pytest.fixture()
def index(tiny, tmp_path) -> KVIndex:
    root = tmp_path / "docs"
    root.mkdir()
    for name, text in DOCS.items():
        (root / name).write_text(text)
    return KVIndex.build(root, tmp_path / "idx", CFG.with_fusion(template_text=True), adapter=tiny, progress=False)


def prompt(index: KVIndex, question: str, tail: str = TAIL) -> str:
    """The prompt of `question` over the chunks retrieved for it: all but one, another for each question."""
    chunks = sorted(index.chunks.all_chunks(), key=lambda c: (c.source, c.ordinal))
    del chunks[QUESTIONS.index(question)]
    context = "\n\n".join(c.text for c in chunks)
    return f"{HEAD}Context information is below.\n---------------------\n{context}{tail.format(q=question)}"


def template_runs(segments) -> list:
    return [s for s in segments if s.label.startswith("template:")]


def ids_of(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_recurring_template_tail_is_read_from_cache_the_second_time(index, tiny):
    generator = FusedGenerator(index)
    first = generator.layout.prompt_segments(prompt(index, QUESTIONS[0]))
    assert first[-1].label != "template" and not template_runs(first)
    assert not template_runs(generator.layout.prompt_segments(prompt(index, QUESTIONS[0])))  # a repeat teaches nothing
    second = generator.layout.prompt_segments(prompt(index, QUESTIONS[1]))
    (run,) = template_runs(second)
    template = ids_of(tiny.tokenizer, TAIL.split("{q}")[0])
    assert len(run.ids) >= len(template) - 2 and all(t in template for t in run.ids)
    question = ids_of(tiny.tokenizer, QUESTIONS[1])
    after = second[second.index(run) + 1 :]
    assert not any(s.cacheable for s in after) and _contains([t for s in after for t in s.ids], question)
    assert index.addressing.key(run.whole) in index.store  # stored when learned
    fusion, plain = FusionConfig(method="reuse", template_text=True), FusionConfig(method="reuse", template_text=False)
    generator.complete(prompt(index, QUESTIONS[2]), fusion=plain)  # the head's cache, made on first use (not "cached")
    on = generator.complete(prompt(index, QUESTIONS[2]), fusion=fusion)
    off = generator.complete(prompt(index, QUESTIONS[2]), fusion=plain)
    assert on.cache_misses == 0 and on.cached_tokens - off.cached_tokens >= len(run.ids)  # counted with the chunks


def test_the_same_question_over_the_same_chunks_teaches_nothing(index, tiny):
    """A question asked again with other instructions after it (a retry, a structured-output variant) shares
    its own text with the first prompt, not a template's: over the same chunks nothing is learned."""
    generator = FusedGenerator(index)
    for extra in ("", " Reply in JSON.", " Reply in one word."):
        segments = generator.layout.prompt_segments(prompt(index, QUESTIONS[0], TAIL + extra))
    assert not template_runs(segments) and not generator.layout.templates.spans(segments[0].ids)


def test_a_tail_one_token_off_the_learned_span_computes_that_token(index, tiny):
    generator = FusedGenerator(index)
    for question in QUESTIONS[:2]:
        generator.layout.prompt_segments(prompt(index, question))
    (span,) = generator.layout.templates.spans(generator.layout.prompt_segments(prompt(index, QUESTIONS[0]))[0].ids)
    near = TAIL.replace("not prior knowledge", "not prior wisdom")
    changed = ids_of(tiny.tokenizer, " wisdom")
    assert len(changed) == 1 and changed[0] not in span
    segments = generator.layout.prompt_segments(prompt(index, QUESTIONS[2], near))
    runs = template_runs(segments)
    assert runs and all(s.whole is not None and len(s.ids) < len(span) for s in runs)  # the parts that agree
    (at,) = [s for s in segments if changed[0] in s.ids]
    assert not at.cacheable


def test_ratio_one_equals_full_with_a_template_span(index):
    generator = FusedGenerator(index)
    for question in QUESTIONS[:2]:
        generator.layout.prompt_segments(prompt(index, question))
    text = prompt(index, QUESTIONS[2])
    assert template_runs(generator.layout.prompt_segments(text))
    exact = generator.complete(text, fusion=FusionConfig(method="cacheblend", ratio=1.0, template_text=True))
    full = generator.complete(text, fusion=FusionConfig(method="full"))
    assert exact.answer == full.answer
    torch.testing.assert_close(exact.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)


def test_a_corrupt_template_cache_is_recomputed_and_the_answer_unchanged(index, caplog):
    generator = FusedGenerator(index)
    for question in QUESTIONS[:2]:
        generator.layout.prompt_segments(prompt(index, question))
    text = prompt(index, QUESTIONS[2])
    (run,) = template_runs(generator.layout.prompt_segments(text))
    fusion = FusionConfig(method="cacheblend", template_text=True)
    before = generator.complete(text, fusion=fusion)
    key = index.addressing.key(run.whole)
    path = index.store.path(key)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # the last layer: found mid-fusion
    path.write_bytes(bytes(raw))
    index.store.memory.remove(key)
    with caplog.at_level(logging.INFO):
        after = generator.complete(text, fusion=fusion)
    assert after.cache_misses == 1 and "made and stored the KV cache" in caplog.text
    assert after.answer == before.answer
    torch.testing.assert_close(after.first_token_logits, before.first_token_logits, atol=1e-4, rtol=0)
    assert generator.complete(text, fusion=fusion).cache_misses == 0  # rewritten, intact


def test_a_span_shrinks_to_what_tails_over_other_chunks_share_and_memory_is_bounded():
    template = tuple(range(100, 130))
    spans = TemplateSpans(max_heads=2)
    assert spans.learn((1,), "a", (7, *template, 50, 51, 52)) == []
    assert spans.learn((1,), "a", (7, *template, 50, 51, 53)) == []  # the same chunks: nothing learned
    assert spans.learn((1,), "b", (8, *template, 50, 51, 54)) == [(*template, 50, 51)]  # shared question words too
    assert spans.learn((1,), "c", (9, *template, 60, 61)) == [template]  # a question without them cuts them off
    assert spans.spans((1,)) == [template]
    assert spans.learn((1,), "d", (9, *template[:10], 70, 71)) == []  # shorter than min_span: nothing learned
    spans.learn((2,), "a", (1, 2))
    spans.learn((3,), "a", (1, 2))
    assert spans.spans((1,)) == []  # the least recently seen head dropped


def test_template_text_is_computed_unless_asked_for(index):
    """Off by default: it costs fidelity (benchmarks/RESULTS.md), so no prompt's template text is read
    from a cache unless the fusion config asks for it."""
    generator = FusedGenerator(index)
    default = FusionConfig(method="reuse")
    assert not default.template_text
    for question in QUESTIONS:
        assert not template_runs(generator.layout.prompt_segments(prompt(index, question), default))
