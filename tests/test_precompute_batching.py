"""Indexing-time precompute: batches of equal-length chunks store the caches a chunk-by-chunk prefill
computes, bit for bit; the writes run behind the compute and a failed write still fails the update."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from rag_kvcache.build.precompute import WriteBehind, compute_caches, equal_length_batches
from rag_kvcache.config import Config
from rag_kvcache.index import KVIndex
from rag_kvcache.store.kvstore import KVStore

WORDS = "ferry harbour dawn crates salt rye keeper lamp granite breakwater market loaf seeds telescope refractor".split()
DOCS = {f"doc{i}.txt": " ".join(f"{WORDS[(7 * i + j) % len(WORDS)]}{j}" for j in range(20 + 9 * i)) + "." for i in range(6)}
CFG = Config(chunk_tokens=24)


@pytest.fixture()
def docs(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    for name, text in DOCS.items():
        (root / name).write_text(text)
    return root


def _chunks(n: int, lengths: tuple[int, ...], seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1000, 2000) for _ in range(rng.choice(lengths))) for _ in range(n)]


def test_batches_hold_one_length_and_cover_every_chunk():
    chunks = _chunks(23, (5, 9, 16))
    batches = equal_length_batches(chunks, 4)
    assert sorted(i for b in batches for i in b) == list(range(23))
    assert all(1 <= len(b) <= 4 and len({len(chunks[i]) for i in b}) == 1 for b in batches)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        next(compute_caches(None, chunks, (), 0))


def test_batched_caches_equal_chunk_by_chunk_bit_for_bit(tiny):
    chunks = _chunks(11, (12, 20))
    context = (101, 2023, 2003, 1037)
    batched = dict(compute_caches(tiny, chunks, context, batch_size=4))
    assert sorted(batched) == list(range(11))
    for i, ids in enumerate(chunks):
        (_, alone), = compute_caches(tiny, [ids], context, batch_size=1)
        assert batched[i].position == alone.position == len(context)
        for layer in range(alone.n_layers):
            for got, want in zip(batched[i].layer(layer), alone.layer(layer)):
                assert got.shape == want.shape == (2, len(ids), 16)  # [H_kv, T, D]
                assert torch.equal(got, want)


def test_index_stores_what_a_full_prefill_computes(tiny, docs, tmp_path):
    index = KVIndex.build(docs, tmp_path / "idx", CFG, adapter=tiny, progress=False)
    chunks = list(index.chunks.all_chunks())
    assert len({len(c.token_ids) for c in chunks}) > 1 and len(chunks) > 4  # several batches, several lengths
    prefix = torch.tensor([index.format.prefix_ids])
    for chunk in chunks:
        keys, values, _ = tiny.prefill(torch.cat([prefix, torch.tensor([chunk.token_ids])], 1))  # L x [1, H_kv, P+T, D]
        stored = index.store.get(index.key(chunk.token_ids))
        for layer in range(len(keys)):
            torch.testing.assert_close(stored.keys[layer], keys[layer][0, :, prefix.shape[1]:], atol=1e-5, rtol=0)
            torch.testing.assert_close(stored.values[layer], values[layer][0, :, prefix.shape[1]:], atol=1e-5, rtol=0)
        with safe_open(index.store.path(index.key(chunk.token_ids)), "pt") as f:  # a plain safetensors file too
            assert len(f.keys()) == 2 * len(keys) and torch.equal(f.get_tensor("v.1"), stored.values[1])


def test_write_behind_keeps_at_most_depth_pending_and_flushes(tiny, tmp_path):
    store = KVStore(tmp_path / "kv")
    chunks = _chunks(7, (8,))
    with WriteBehind(store, depth=2) as writer:
        for i, kv in compute_caches(tiny, chunks, (), batch_size=3):
            writer.put(f"{i:032x}", kv)
            assert len(writer._pending) <= 2
    assert all(store.get(f"{i:032x}") is not None for i in range(7))
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        WriteBehind(store, depth=0)


def test_a_failed_background_write_fails_the_update_and_commits_nothing(tiny, docs, tmp_path):
    """Fault injection: the store's folder for one chunk's cache is a file, so that write fails on the
    writer thread; the update raises it and the index keeps no chunk without its cache."""
    index = KVIndex.create(tmp_path / "idx", CFG, adapter=tiny)
    from rag_kvcache.retrieval.chunking import chunk_document

    first = chunk_document(DOCS["doc3.txt"], "doc3.txt", tiny.tokenizer, CFG.chunk_tokens)[0].token_ids
    blocker = index.store.path(index.key(first)).parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        index.update(docs, progress=False)
    assert len(index.chunks) == 0
    blocker.unlink()
    report = index.update(docs, progress=False)  # re-run: resumes, the caches written before are kept
    assert len(index.chunks) == len(report.new_chunks) > 0
    assert all(index.key(c.token_ids) in index.store for c in index.chunks.all_chunks())
