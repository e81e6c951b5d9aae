"""`chunk_prefill="neighbours"` (issue 13): each chunk's caches also computed behind its 1..N most similar
chunks, addressed by that context, the one read matching the number of chunks before it in the prompt;
exact only where the prompt's tokens before it are that context, and read as the mean of it and the
behind-prefix cache (`BlendKV`) where they are not."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from test_fusion import ATOL

from rag_kvcache.config import Config, FusionConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.cache import BlendKV, ChunkKV
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.ops import rotate_keys, rotation
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.neighbours import NeighbourTable
from rag_kvcache.query.generator import FusedGenerator

NEIGHBOURS = Config(
    index=IndexSettings(chunk_tokens=24, chunk_prefill="neighbours", context_chunks=2), query=QueryConfig(top_k=3)
).with_index(codec="none")
DOCS = {
    "lighthouse.txt": "The lighthouse on Tessaly was lit in 1856. Its keeper Ada Rennick kept a diary of ships that "
    "passed the point, the weather each morning, and the state of the lamp and its oil.",
    "observatory.txt": "The main telescope of the Veldmark Observatory is named Harrow's Eye. It is a refractor "
    "built in 1911 and it still observes double stars on clear winter nights.",
    "bakery.txt": "Saltmere's bakery sells a dark rye loaf with caraway seeds every market day, and on Sundays "
    "it bakes small honey cakes for the children of the harbour families.",
}


@pytest.fixture()
def index(tiny, tmp_path) -> KVIndex:
    for name, text in DOCS.items():
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    return KVIndex.build(tmp_path / "docs", tmp_path / "idx", NEIGHBOURS, adapter=tiny, progress=False)


def some_chunk(index: KVIndex):
    return next(index.chunks.all_chunks())


def layout(index: KVIndex, near) -> tuple[int, ...]:
    sep = index.format.separator_ids
    return index.format.prefix_ids + tuple(t for ids in reversed(near) for t in (*ids, *sep))


@pytest.mark.parametrize(("depth", "n_near"), [(1, 1), (2, 2), (5, 2)])
def test_neighbour_cache_is_the_chunk_behind_as_many_similar_chunks_as_precede_it(tiny, index, depth, n_near):
    chunk = some_chunk(index)
    near = [h.chunk.token_ids for h in index.search(chunk.text, 3) if h.chunk.id != chunk.id][:2]
    table = NeighbourTable(index.path)
    assert len(table) == len(list(index.chunks.all_chunks())) and len(near) == 2
    context = layout(index, near[:n_near])
    assert index.addressing.contexts_at(depth, chunk.token_ids) == (context, index.format.prefix_ids)
    assert index.addressing.contexts_at(0, chunk.token_ids) == (index.format.prefix_ids,)
    stored = index.store.get(index.addressing.key(chunk.token_ids, context))
    assert stored.position == len(context)
    past = tiny.prefill(torch.tensor([context]))[:2]
    keys, values, _ = tiny.prefill(torch.tensor([chunk.token_ids]), past)
    for layer in range(tiny.layout.n_layers):
        torch.testing.assert_close(stored.keys[layer], keys[layer][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(stored.values[layer], values[layer][0], atol=ATOL, rtol=0)


def test_first_chunk_exact_later_chunks_not_and_prefix_equals_full(index):
    question = "Who kept the lighthouse diary of ships?"
    fmt = index.format
    segments = fmt.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], fmt.question_ids(index.adapter.tokenizer, question)
    )
    caches = index.caches.open(segments)
    inp = FusionInput.build(segments, caches.sources, caches.contexts)
    chunks = [p for p in inp.parts if p.segment.label.startswith("chunk")]
    assert chunks[0].exact and not any(p.exact for p in chunks[1:])
    assert caches.contexts[3] is None  # a later chunk reads its neighbour cache, blended: exact behind no prompt
    (near, prefix) = index.addressing.contexts_at(1, segments[3].ids)
    blend = caches.sources[3]
    assert isinstance(blend, BlendKV) and blend.position == len(near) and prefix == fmt.prefix_ids
    assert [s.position for s in blend.sources] == [len(near), len(fmt.prefix_ids)]
    gen = FusedGenerator(index)
    full = gen.fuse(segments, FusionConfig(method="full")).result
    torch.testing.assert_close(
        gen.fuse(segments, FusionConfig(method="prefix")).result.logits, full.logits, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("depth", [1, 2])
def test_a_chunk_behind_exactly_its_neighbours_is_exact(index, depth):
    """A chunk with `depth` chunks before it reads its cache behind its `depth` most similar chunks: exact
    where the prompt holds just them before it, most similar last (e.g. the second chunk of a prompt
    whose first is its most similar, as retrieval often makes it)."""
    chunk = some_chunk(index)
    near = NeighbourTable(index.path)[index.addressing.neighbour_key(chunk.token_ids)]
    question = index.format.question_ids(index.adapter.tokenizer, "Who kept the diary?")
    segments = index.format.segments([*(tuple(n) for n in reversed(near[:depth])), chunk.token_ids], question)
    caches = index.caches.open(segments)
    inp = FusionInput.build(segments, caches.sources, caches.contexts)
    chunks = [p for p in inp.parts if p.segment.label.startswith("chunk")]
    assert chunks[0].exact and chunks[-1].exact  # a middle chunk reads its own neighbours' cache: inexact
    assert not isinstance(caches.sources[-2], BlendKV)  # the exact cache alone, not blended
    gen = FusedGenerator(index)
    torch.testing.assert_close(
        gen.fuse(segments, FusionConfig(method="prefix")).result.logits,
        gen.fuse(segments, FusionConfig(method="full")).result.logits,
        atol=ATOL,
        rtol=0,
    )
    swapped = index.format.segments([tuple(near[1]), chunk.token_ids], question)  # another chunk first: inexact
    caches = index.caches.open(swapped)
    assert not FusionInput.build(swapped, caches.sources, caches.contexts).parts[3].exact


def test_another_setting_is_a_miss(tiny, index, tmp_path):
    """The namespace holds `chunk_prefill`: the same chunk under another setting (an index of the same documents
    built with it) is another key, never this index's cache."""
    chunk = some_chunk(index)
    config = NEIGHBOURS.with_index(chunk_prefill="behind_prefix")
    plain = KVIndex.build(tmp_path / "docs", tmp_path / "plain", config, adapter=tiny, progress=False)
    others = [h.chunk.token_ids for h in index.search(chunk.text, 4) if h.chunk.id != chunk.id]
    assert (
        len(others) == 3 and index.addressing.key(chunk.token_ids, layout(index, others)) not in index.store
    )  # 3 > context_chunks
    assert plain.addressing.key(chunk.token_ids) not in index.store
    assert plain.addressing.contexts_at(2, chunk.token_ids) == (
        plain.format.prefix_ids,
    )  # no neighbours outside the mode


def test_a_run_killed_before_recording_neighbours_is_completed_by_the_next(tiny, index, tmp_path, monkeypatch):
    """Chunks are committed before their neighbours are recorded: a run killed in between leaves chunks
    without neighbour caches, and the next update (with nothing new to index) computes them."""
    (tmp_path / "docs" / "harbour.txt").write_text(
        "The harbour of Saltmere freezes over in hard winters, and the "
        "fishing boats are then drawn up on the shingle beach."
    )

    def killed(chunks, progress=True):
        raise KeyboardInterrupt("killed while computing neighbour caches")

    monkeypatch.setattr(index.maker, "precompute_neighbours", killed)
    with pytest.raises(KeyboardInterrupt):
        index.update(tmp_path / "docs", progress=False)
    monkeypatch.undo()
    reopened = KVIndex.open(index.path, adapter=tiny)
    missing = list(reopened.maker.lacking_neighbour_caches())
    assert missing and all(c.source.endswith("harbour.txt") for c in missing)
    report = reopened.update(tmp_path / "docs", progress=False)
    assert not report.new_chunks and list(reopened.maker.lacking_neighbour_caches()) == []
    for chunk in missing:
        context = reopened.addressing.contexts_at(2, chunk.token_ids)[0]
        assert (
            context != reopened.addressing.chunk_context
            and reopened.addressing.key(chunk.token_ids, context) in reopened.store
        )


def moved(kv: ChunkKV, delta: int, inv_freq) -> ChunkKV:
    """The same cache as if computed `delta` positions later (RoPE composes)."""
    turn = rotation(delta, inv_freq)
    return ChunkKV([rotate_keys(k, *turn) for k in kv.keys], list(kv.values), kv.position + delta)


def test_a_blend_is_the_mean_of_its_caches_at_the_first_ones_position(tiny, index):
    chunk = some_chunk(index)
    near, prefix = index.addressing.contexts_at(2, chunk.token_ids)
    a, b = (index.store.get(index.addressing.key(chunk.token_ids, c)) for c in (near, prefix))
    assert a.position != b.position
    blend = BlendKV((a, b), tiny.inv_freq)
    same = BlendKV((a, moved(a, 37, tiny.inv_freq)), tiny.inv_freq)  # one cache at two positions: itself
    b_there = moved(b, a.position - b.position, tiny.inv_freq)
    for layer in range(tiny.layout.n_layers):
        keys, values = blend.layer(layer)
        torch.testing.assert_close(keys, (a.keys[layer] + b_there.keys[layer]) / 2, atol=ATOL, rtol=0)
        torch.testing.assert_close(values, (a.values[layer] + b.values[layer]) / 2, atol=ATOL, rtol=0)
        torch.testing.assert_close(same.layer(layer), a.layer(layer), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="two or more caches of one chunk"):
        BlendKV((a,), tiny.inv_freq)
    other = index.store.get(
        index.addressing.key(
            next(
                c
                for c in index.chunks.all_chunks()
                if c.token_ids != chunk.token_ids and len(c.token_ids) != len(chunk.token_ids)
            ).token_ids
        )
    )
    with pytest.raises(ValueError, match="two or more caches of one chunk"):
        BlendKV((a, other), tiny.inv_freq)


def test_a_corrupt_cache_in_a_blend_is_recomputed_and_the_answer_unchanged(tiny, index, caplog):
    index = KVIndex.open(
        index.path, NEIGHBOURS.with_runtime(storage=replace(NEIGHBOURS.runtime.storage, memory_bytes=0)), adapter=tiny
    )
    question = "Who kept the lighthouse diary of ships?"
    fmt = index.format
    segments = fmt.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], fmt.question_ids(index.adapter.tokenizer, question)
    )
    gen = FusedGenerator(index)
    epic = FusionConfig(method="epic", epic_k=4)
    before = gen.fuse(segments, epic).result
    near, _ = index.addressing.contexts_at(1, segments[3].ids)
    path = index.store.path(index.addressing.key(segments[3].ids, near))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # the last layer: found mid-fusion, by the reader
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO):
        after = gen.fuse(segments, epic)
    assert after.cache_misses == 1 and "made and stored the KV cache" in caplog.text
    torch.testing.assert_close(after.result.logits, before.logits, atol=ATOL, rtol=0)
