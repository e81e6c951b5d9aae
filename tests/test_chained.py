"""`chunk_prefill="chained"` (issue 33 item 1): groups of similar chunks, each group prefilled as one sequence
behind the stored caches of the most similar chunks computed before it (re-rotated into place, as a prompt reads
them), so every chunk's one cache has seen similar chunks, for one forward over the corpus' tokens."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_cached_neighbours import assert_same, text_cache, write_docs

from rag_kvcache.config import Config, IndexSettings, QueryConfig
from rag_kvcache.errors import ConfigError
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.grouping import earlier_neighbours
from rag_kvcache.indexing.precompute import compute_behind_cached

# caches stored as computed, so a context read from caches is what the indexing forward attended to
CHAINED = Config(
    index=IndexSettings(chunk_tokens=24, chunk_prefill="chained", context_chunks=2, codec="none"),
    query=QueryConfig(top_k=3),
)


@pytest.fixture(params=["tiny", "bpe_tiny"])
def model(request):
    """MiniLM's WordPiece (no separator token between chunks) and a byte-level BPE (a separator token)."""
    return request.getfixturevalue(request.param)


@pytest.fixture()
def index(model, tmp_path) -> KVIndex:
    write_docs(tmp_path / "docs")
    return KVIndex.build(tmp_path / "docs", tmp_path / "idx", CHAINED, adapter=model, progress=False)


def test_earlier_neighbours_come_from_groups_before_most_similar_first():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(12, 8)).astype(np.float32)
    groups = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11]]
    found = earlier_neighbours(rows, groups, 2)
    assert found[0] == [] and all(len(near) == 2 for near in found[1:])
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    for g, near in enumerate(found[1:], 1):
        earlier = [i for group in groups[:g] for i in group]
        centre = unit[groups[g]].mean(0)
        best = sorted(earlier, key=lambda i: -float(unit[i] @ centre))[:2]
        assert near == best
    assert earlier_neighbours(rows, groups, 0) == [[]] * 4
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        earlier_neighbours(rows, groups, -1)


def test_each_cache_equals_its_chunk_behind_its_recorded_context_read_from_caches(tiny, tmp_path):
    """The invariant: every chunk's stored cache equals the chunk computed behind its recorded context (the
    prefix, its group's context, the chunks before it in its group), that context read from the stored caches;
    only the first group's seed is behind the prefix alone, and each chunk has one cache. (Under a tokenizer
    whose separator is a token, the separators inside a group are computed in the group's forward, not read
    from the separator's cache: equal to float tolerance only for each group's first chunk.)"""
    write_docs(tmp_path / "docs")
    index = KVIndex.build(tmp_path / "docs", tmp_path / "idx", CHAINED, adapter=tiny, progress=False)
    model = tiny
    live = index.maker.live_keys()
    assert len(live) == len(index.chunks) + 1 + bool(index.format.separator_ids)  # and the prefix's, the separator's
    assert sorted(p.stem for p in index.store.disk.files()) == sorted(live)
    alone = 0
    for ids in (c.token_ids for c in index.chunks.all_chunks()):
        near = index.addressing.near(ids)
        stored = index.store.get(index.addressing.own_key(ids))
        if not near:
            alone += 1
            assert_same(stored, text_cache(model, ids, index.format.prefix_ids))
            continue
        remade = compute_behind_cached(model, ids, index.maker.cached_context(near), index.format.separator_ids)
        assert_same(stored, remade)
    assert alone == 1


def test_ray_workers_are_refused(index):
    chunk = next(index.chunks.all_chunks())
    with pytest.raises(ConfigError, match="chained"):
        index.maker.precompute_grouped([chunk], np.zeros((1, 4), np.float32), False, workers=object())  # type: ignore[arg-type]


def test_a_prompt_reads_every_cache_and_a_missing_one_is_recomputed(model, index, caplog):
    """Every chunk a prompt retrieves has its one cache; a missing one is recomputed behind its recorded
    context (read from caches), stored again and logged."""
    question = "Who kept the diary?"
    chunks = [h.chunk.token_ids for h in index.search(question, 3)]
    segments = index.format.segments(chunks, index.format.question_ids(model.tokenizer, question))
    assert index.caches.open(segments).missing == 0
    key = index.addressing.own_key(chunks[-1])
    index.store.memory.remove(key)
    index.store.disk.remove(key)
    with caplog.at_level(logging.WARNING):
        assert index.caches.open(segments).missing == 1
    assert "recomputed and rewrote" in caplog.text and key in index.store.disk
