"""Any prompt through `FusedGenerator.complete` on the tiny Llama: the indexed chunks found in it are
read from their caches (slices included), everything else is computed, and a prompt without
indexed text answers exactly as `full`."""

from __future__ import annotations

import logging

import pytest
import torch

from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.methods import get_method
from rag_kvcache.engine.profiling import StageClock
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator

DOCS = {
    "lighthouse.txt": "The lighthouse on Tessaly was lit in 1856 and its keeper Ada Rennick kept a diary of every "
    "ship that passed the northern reef, including the wreck of the brig Marigold in a winter storm.",
    "observatory.txt": "The main telescope of the Veldmark Observatory is named Harrow's Eye; it is a refractor with "
    "a lens ground by the optician Selma Voss, and it was moved to the hill above the town in 1902.",
}
CFG = Config(
    index=IndexSettings(chunk_tokens=24), query=QueryConfig(generation=GenerationConfig(max_new_tokens=5))
).with_index(codec="none")  # lossless: exact


@pytest.fixture(scope="module")
def index(tiny, tmp_path_factory) -> KVIndex:
    root = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (root / name).write_text(text)
    return KVIndex.build(root, tmp_path_factory.mktemp("idx"), CFG, adapter=tiny, progress=False)


def chunk_texts(index: KVIndex) -> list:
    return sorted(index.chunks.all_chunks(), key=lambda c: (c.source, c.ordinal))


def ask(index: KVIndex, prompt: str, method: str, ratio: float = 0.15):
    return FusedGenerator(index).complete(prompt, fusion=FusionConfig(method=method, ratio=ratio))


def test_prompt_without_indexed_text_answers_as_full(index, caplog):
    prompt = "Write one sentence about the weather in a small harbour town where fishing boats come home at dusk."
    with caplog.at_level(logging.WARNING):
        fused = ask(index, prompt, "cacheblend")
    assert "found no indexed text" in caplog.text
    full = ask(index, prompt, "full")
    assert fused.answer == full.answer
    torch.testing.assert_close(fused.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)


def test_quoted_chunks_are_read_from_cache(index):
    chunks = chunk_texts(index)
    context = "\n\n".join(c.text for c in chunks)
    prompt = f"Use the following context.\nContext: {context}\n\nQuestion: who ground the lens?\nAnswer:"
    segments = FusedGenerator(index).layout.prompt_segments(prompt)
    matched = [s for s in segments if s.cacheable and s.label != "prefix"]
    assert {s.label for s in matched} == {f"chunk:{c.id}" for c in chunks}
    assert sum(len(s.ids) for s in matched) >= 0.9 * sum(len(c.token_ids) for c in chunks)
    answer = ask(index, prompt, "cacheblend")
    assert answer.cached_tokens >= sum(len(s.ids) for s in matched) * 0.8 and answer.cache_misses == 0


@pytest.mark.parametrize("method", ["prefix", "cacheblend"])
def test_exact_methods_over_matched_prompts_equal_full(index, method):
    """Ratio 1.0 and prefix caching stay exact with matched slices, partial and repeated chunks."""
    first, second = chunk_texts(index)[:2]
    half = first.text[len(first.text) // 2 :]
    prompt = f"Notes: {half}\n\n{second.text}\n\nAgain: {second.text}\n\nQuestion: when?\nAnswer:"
    assert sum(s.cacheable for s in FusedGenerator(index).layout.prompt_segments(prompt)) >= 2
    fused, full = ask(index, prompt, method, ratio=1.0), ask(index, prompt, "full")
    assert fused.answer == full.answer
    torch.testing.assert_close(fused.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)


def test_a_slice_at_its_own_place_is_exact(index, tiny):
    """A chunk's cache sliced from offset a and placed right after the chunk's own first a tokens (and
    the context it was computed behind) is what a full prefill computes there: reuse then equals full."""
    chunk = chunk_texts(index)[0].token_ids
    a = 7
    question = tuple(tiny.tokenizer(" and then?", add_special_tokens=False).input_ids)
    segments = [
        Segment(index.format.prefix_ids, True, "prefix"),
        Segment(chunk[:a], False, "head"),
        Segment(chunk[a:], True, "tail", whole=chunk, offset=a),
        Segment(question, False, "question"),
    ]
    caches = index.caches.open(segments)
    inp = FusionInput.build(segments, caches.sources, caches.contexts)
    assert [p.exact for p in inp.parts] == [True, False, True, False]
    assert caches.sources[2].position == len(index.format.prefix_ids) + a
    fusion = FusionConfig(method="reuse")
    reuse = get_method("reuse")(tiny, inp, fusion, StageClock("cpu"), None)
    full = get_method("full")(tiny, FusionInput.build(segments, [None] * 4, [()] * 4), fusion, StageClock("cpu"), None)
    torch.testing.assert_close(reuse.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert reuse.recomputed_tokens == a + len(question)


def test_segment_refuses_ids_that_are_not_a_run_of_whole():
    with pytest.raises(ValueError, match="not a cacheable run"):
        Segment((1, 2), True, "x", whole=(1, 3, 2), offset=0)


INSTRUCTIONS = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, say that you don't know.\n\n"
)


def test_a_templates_head_is_cached_once_and_read_after(index, tiny):
    """A pipeline's instructions before the quoted chunks (no indexed text) are cached at position 0
    on the first prompt and read by the next ones: only the text between and after chunks is computed."""
    context = "\n\n".join(c.text for c in chunk_texts(index))
    prompts = [
        f"{INSTRUCTIONS}{context}\n\nQuestion: {q}\nAnswer:" for q in ("who ground the lens?", "when was it lit?")
    ]
    generator = FusedGenerator(index)
    head, edge, *rest = generator.layout.prompt_segments(prompts[0])
    assert head.cacheable and head.label == "prefix" and not edge.cacheable
    assert len(edge.ids) == rest[0].offset + 1 and rest[0].label.startswith("chunk:")
    assert len(head.ids) + len(edge.ids) >= len(tiny.tokenizer(INSTRUCTIONS, add_special_tokens=False).input_ids)
    reordered = "\n\n".join(c.text for c in reversed(chunk_texts(index)))
    assert generator.layout.prompt_segments(f"{INSTRUCTIONS}{reordered}\n\nQuestion: why?\nAnswer:")[0].ids == head.ids
    key = index.addressing.key(head.ids, ())
    assert key not in index.caches.request_tier("")
    ask(index, prompts[0], "reuse")
    assert key in index.caches.request_tier("")  # computed and kept by the first prompt that had it: request text,
    assert key not in index.store  # in memory only, never on disk
    segments = generator.layout.prompt_segments(prompts[1])
    assert segments[0].ids == head.ids
    second = ask(index, prompts[1], "reuse")
    assert second.recomputed_tokens == sum(len(s.ids) for s in segments if not s.cacheable)
    assert second.cache_misses == 0
    exact, full = ask(index, prompts[1], "cacheblend", ratio=1.0), ask(index, prompts[1], "full")
    torch.testing.assert_close(exact.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)


def test_a_short_head_stays_computed(index):
    context = chunk_texts(index)[0].text
    segments = FusedGenerator(index).layout.prompt_segments(f"Notes: {context}\n\nQuestion: when?\nAnswer:")
    assert not segments[0].cacheable and segments[1].label.startswith("chunk:")


def test_the_head_ends_where_the_chunk_text_begins_not_at_the_runs_offset(index):
    """A prompt that quotes a chunk from its middle (its first run starts deep in the chunk) caches the
    same head as one that quotes whole chunks. Cut at the run's offset, the head lost as many tokens of
    the instructions as the chunk had before the run: a different head, and a new cache computed, for
    every prompt (LlamaIndex's template on MuSiQue: 7 heads in 12 prompts)."""
    chunk = chunk_texts(index)[0]
    generator = FusedGenerator(index)
    whole = generator.layout.prompt_segments(f"{INSTRUCTIONS}{chunk.text}\n\nQuestion: why?\nAnswer:")
    words = chunk.text.split()
    part = generator.layout.prompt_segments(f"{INSTRUCTIONS}{' '.join(words[4:])}\n\nQuestion: why?\nAnswer:")
    run = next(s for s in part if s.cacheable and s.label != "prefix")
    assert run.offset >= 4 and run.label == f"chunk:{chunk.id}"  # the run starts deep in the chunk
    assert whole[0].label == part[0].label == "prefix"
    assert part[0].ids == whole[0].ids


def test_the_first_chunk_behind_a_templates_head_is_exact_from_the_second_prompt_on(index):
    """Behind a pipeline's own instructions the first chunk's behind-prefix cache is not exact; its run's
    cache behind exactly the prompt's tokens before it is made by the first prompt with that head and
    chunk, and read (exact) by the next: `prefix` then equals `full` computing only what follows it."""
    instructions = (
        "Answer the question from the excerpts of the archive below, quoting names and dates as they "
        "are written there, and say so when the excerpts do not tell.\n\n"
    )
    context = "\n\n".join(c.text for c in chunk_texts(index))
    prompts = [
        f"{instructions}{context}\n\nQuestion: {q}\nAnswer:" for q in ("who ground the lens?", "when was it lit?")
    ]
    generator = FusedGenerator(index)
    segments = generator.layout.prompt_segments(prompts[1])
    keys = [index.addressing.key(segments[2].ids, tuple(t for s in segments[:2] for t in s.ids))]
    assert segments[2].label.startswith("chunk:") and keys[0] not in index.caches.request_tier("")
    first = ask(index, prompts[0], "reuse")
    assert keys[0] in index.caches.request_tier("") and first.cache_misses == 0  # made now, not a missing indexed cache
    caches = index.caches.open(segments)
    inp = FusionInput.build(segments, caches.sources, caches.contexts)
    head, edge, chunk = inp.parts[:3]
    assert head.exact and chunk.kv is not None and chunk.exact and not [p for p in inp.parts[3:] if p.exact]
    exact, full = ask(index, prompts[1], "prefix"), ask(index, prompts[1], "full")
    torch.testing.assert_close(exact.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)
    assert exact.recomputed_tokens == inp.n_tokens - len(head.segment.ids) - len(chunk.segment.ids)


def test_request_text_caches_stay_in_memory_within_each_keys_budget(tiny, tmp_path):
    """Each new prompt head stored ~94 MB on disk with no budget, so any client could fill it. Caches of
    request text are now kept in memory per API key, least recently used out past `request_bytes`, never
    on disk: a flood of heads from one key neither grows the disk nor evicts another key's head."""
    (tmp_path / "docs").mkdir()
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).write_text(text)
    index = KVIndex.build(
        tmp_path / "docs", tmp_path / "idx", CFG.with_storage(request_bytes=150_000), adapter=tiny, progress=False
    )
    on_disk = set((tmp_path / "idx" / "kv").rglob("*.safetensors"))
    generator, context = FusedGenerator(index), "\n\n".join(c.text for c in chunk_texts(index))

    def send(head: str, salt: str) -> list:
        segments = generator.layout.prompt_segments(f"{head}{context}\n\nQuestion: who ground the lens?\nAnswer:")
        generator.start(segments, FusionConfig(method="reuse"), GenerationConfig(max_new_tokens=1), salt)
        return segments

    theirs = send(INSTRUCTIONS, "key-b")
    for i in range(6):
        send(f"Instructions number {i} for this pipeline. {INSTRUCTIONS}", f"key-a:salt-{i % 2}")
    mine = index.caches.request_tier("key-a")
    assert 0 < mine.nbytes <= 150_000 and mine.stats.evictions > 0
    assert index.addressing.key(theirs[0].ids, (), "key-b") in index.caches.request_tier("key-b")
    assert set((tmp_path / "idx" / "kv").rglob("*.safetensors")) == on_disk
