"""Relevance checks that read the chunk caches (`rag_kvcache.query.relevance`): every chunk checked in one batched
forward, only the check's question computed; each verdict what a full prefill of its check prompt gives where the
chunk's cache is exact there, `reuse`'s where it is not, and `prefix`'s with `exact=True`."""

from __future__ import annotations

import pytest
import torch
from test_faults import CFG, QUESTION, write_docs

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.query.relevance import RELEVANCE_CHECK, RelevanceCheck

BEHIND = CFG.with_index(chunk_prefill="behind_prefix")  # each chunk's cache exact right after the prefix, as in a check


@pytest.fixture(scope="module")
def generator(tiny, tmp_path_factory) -> FusedGenerator:
    root = tmp_path_factory.mktemp("relevance")
    return FusedGenerator(
        KVIndex.build(write_docs(root / "docs", 3), root / "index", BEHIND, adapter=tiny, progress=False)
    )


def test_a_check_computes_only_its_question_and_equals_a_full_prefill(generator):
    index = generator.index
    chunks = [hit.chunk for hit in index.search(QUESTION, 3)]
    check = RelevanceCheck(generator)
    verdicts = check(QUESTION, chunks)
    question = index.format.question_ids(index.adapter.tokenizer, RELEVANCE_CHECK.format(question=QUESTION))
    assert [v.chunk for v in verdicts] == chunks
    for verdict, chunk in zip(verdicts, chunks):
        assert verdict.computed_tokens == len(question)  # the prefix and the chunk read from their caches
        logits = generator.fuse(
            index.format.segments([chunk.token_ids], question), FusionConfig(method="full")
        ).result.logits
        p = torch.softmax(logits.float(), dim=-1)  # [V]
        want = float(p[check.yes].sum() / (p[check.yes].sum() + p[check.no].sum()))
        assert verdict.p_yes == pytest.approx(want, abs=1e-4)
        assert verdict.relevant == (verdict.p_yes >= 0.5)


@pytest.mark.parametrize(
    "template,threshold,message",
    [
        ("Is it relevant?", 0.5, "must contain '{question}'"),
        (RELEVANCE_CHECK, 1.5, "threshold must be in"),
    ],
)
def test_a_bad_check_is_refused(generator, template, threshold, message):
    with pytest.raises(RagKVCacheError, match=message):
        RelevanceCheck(generator, template, threshold)


@pytest.mark.parametrize(
    "chunk_prefill,exact,method",
    [
        ("grouped", False, "reuse"),
        ("isolated", False, "reuse"),
        ("grouped", True, "prefix"),
        ("isolated", True, "prefix"),
    ],
)
def test_chunk_caches_that_are_not_exact_are_read_as_reuse_reads_them_or_computed(
    tiny, tmp_path, chunk_prefill, exact, method
):
    """Indexes whose chunk caches are not what a full prefill computes in a check prompt (`grouped`: computed
    behind their group's earlier chunks; `isolated`: at position 0, not behind the prefix). Read (the default),
    each chunk's cache is re-rotated to its place and only the check question computed: the verdict equals the
    `reuse` method's for that check prompt. With `exact=True` the chunk's tokens are computed: `prefix`'s."""
    index = KVIndex.build(
        write_docs(tmp_path / "docs", 3),
        tmp_path / "index",
        CFG.with_index(chunk_prefill=chunk_prefill),
        adapter=tiny,
        progress=False,
    )
    generator = FusedGenerator(index)
    chunks = [hit.chunk for hit in index.search(QUESTION, 3)]
    check = RelevanceCheck(generator, exact=exact)
    question = index.format.question_ids(index.adapter.tokenizer, RELEVANCE_CHECK.format(question=QUESTION))
    moved = 0
    for verdict, chunk in zip(check(QUESTION, chunks), chunks):
        segments = index.format.segments([chunk.token_ids], question)
        fused = generator.fuse(segments, FusionConfig(method=method)).result
        p = torch.softmax(fused.logits.float(), dim=-1)  # [V]
        assert verdict.p_yes == pytest.approx(
            float(p[check.yes].sum() / (p[check.yes].sum() + p[check.no].sum())), abs=1e-4
        )
        opened = index.caches.open(segments)
        inexact = not FusionInput.build(segments, opened.sources, opened.contexts).parts[1].exact
        assert verdict.computed_tokens == len(question) + (len(chunk.token_ids) if exact and inexact else 0)
        moved += opened.sources[1].position != len(segments[0].ids)
    assert moved > 0  # some chunk's cache was computed elsewhere than its place in the check prompt


@pytest.mark.parametrize("fault", ["missing", "bit_flip"])
def test_a_damaged_chunk_cache_is_recomputed_and_the_verdict_unchanged(tiny, tmp_path, fault):
    """A chunk's cache file missing (recomputed when opened: its tokens counted as computed) or with a flipped
    byte (found when its layer is read, recomputed then): the verdicts are those of the intact caches."""
    index = KVIndex.build(write_docs(tmp_path / "docs", 3), tmp_path / "index", BEHIND, adapter=tiny, progress=False)
    chunks = [hit.chunk for hit in index.search(QUESTION, 3)]
    check = RelevanceCheck(FusedGenerator(index))
    before = check(QUESTION, chunks)
    path = index.store.path(index.addressing.key(chunks[1].token_ids))
    if fault == "missing":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
    after = check(QUESTION, chunks)
    assert [v.p_yes for v in after] == pytest.approx([v.p_yes for v in before], abs=1e-5)
    grown = [a.computed_tokens - b.computed_tokens for a, b in zip(after, before)]
    assert grown == [0, len(chunks[1].token_ids) if fault == "missing" else 0, 0]
    assert index.store.get(index.addressing.key(chunks[1].token_ids)) is not None  # rewritten, intact


def test_a_text_is_checked_by_computing_it_never_from_a_cache(generator):
    """A passage given as text is computed with the question (the full prefill of its check prompt), whatever
    chunk of the index it resembles; a chunk's cache is read only for the chunk itself."""
    index = generator.index
    chunk = index.search(QUESTION, 1)[0].chunk
    text = "Banana bread is baked with ripe bananas, flour, butter and a little caraway."
    check = RelevanceCheck(generator)
    read, computed = check(QUESTION, [chunk, text])
    ids = tuple(index.adapter.tokenizer(text, add_special_tokens=False).input_ids)
    question = index.format.question_ids(index.adapter.tokenizer, RELEVANCE_CHECK.format(question=QUESTION))
    assert computed.chunk == text and computed.computed_tokens == len(ids) + len(question)
    logits = generator.fuse(index.format.segments([ids], question), FusionConfig(method="full")).result.logits
    p = torch.softmax(logits.float(), dim=-1)  # [V]
    assert computed.p_yes == pytest.approx(
        float(p[check.yes].sum() / (p[check.yes].sum() + p[check.no].sum())), abs=1e-4
    )
    assert read.chunk == chunk and read.computed_tokens == len(question) and read.p_yes != computed.p_yes


@pytest.mark.parametrize("what", ["question", "passage"])
def test_an_over_long_check_is_refused_naming_the_limit_before_computing(generator, what, monkeypatch):
    """A 200,000-character question was computed whole, and OOM-killed at 17 GB. A check prompt over
    `max_prompt_tokens` (8,192 by default, as the server's prompts; or the model's context) is refused, nothing
    computed."""
    long = " ".join(["telescope"] * 20_000)  # 199,999 characters
    monkeypatch.setattr(generator.adapter, "extend_rows", lambda *a: pytest.fail("computed an over-long check"))
    chunk = generator.index.search(QUESTION, 1)[0].chunk
    question, passages = (long, [chunk]) if what == "question" else (QUESTION, [long])
    limit = min(8192, generator.adapter.context_length)  # 4,096: the tiny model's context
    with pytest.raises(ValueError, match=rf"check prompt of \d+ tokens, over the limit of {limit} tokens"):
        RelevanceCheck(generator)(question, passages)
    with pytest.raises(RagKVCacheError, match="over the limit of 40 tokens"):
        RelevanceCheck(generator, max_prompt_tokens=40)(QUESTION, [QUESTION * 3])
