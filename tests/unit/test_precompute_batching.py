"""Indexing-time precompute: packs of chunks of any lengths store the caches a chunk-by-chunk prefill
computes, to float rounding (bit for bit on some CPUs, not on others: a BLAS picks its kernel by the matmul's
row count), and a full prefill to float tolerance; the writes run behind the compute and a
failed write still fails the update."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from safetensors import safe_open

from rag_kvcache.config import Config, IndexSettings
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.precompute import WriteBehind, compute_caches, token_packs
from rag_kvcache.store.backend import encode_entry
from rag_kvcache.store.kvstore import KVStore

WORDS = (
    "ferry harbour dawn crates salt rye keeper lamp granite breakwater market loaf seeds telescope refractor".split()
)
DOCS = {
    f"doc{i}.txt": " ".join(f"{WORDS[(7 * i + j) % len(WORDS)]}{j}" for j in range(20 + 9 * i)) + "." for i in range(6)
}
# behind the prefix alone, and lossless: each stored cache equals a prefill of the prefix and its chunk
CFG = Config(index=IndexSettings(chunk_tokens=24, chunk_prefill="behind_prefix", codec="none"))


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


def test_packs_hold_consecutive_chunks_within_the_budget_and_cover_every_chunk():
    chunks = _chunks(23, (5, 9, 16))
    packs = token_packs(chunks, 30)
    assert [i for p in packs for i in p] == list(range(23))
    assert all(sum(len(chunks[i]) for i in p) <= 30 for p in packs)
    assert all(sum(len(chunks[i]) for i in p) + len(chunks[q[0]]) > 30 for p, q in zip(packs, packs[1:]))  # full
    assert token_packs(chunks, 4) == [[i] for i in range(23)]  # a chunk longer than the budget goes alone
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        next(compute_caches(None, chunks, (), 0))


@pytest.mark.parametrize("context", [(101, 2023, 2003, 1037), ()])
def test_packed_caches_equal_chunk_by_chunk_and_a_full_prefill(tiny, context):
    chunks = _chunks(11, (4, 12, 20, 31))  # not 1-3 tokens alone: MKL takes another kernel for matmuls of <= 3 rows
    packed = dict(compute_caches(tiny, chunks, context, 64))
    assert sorted(packed) == list(range(11))
    for i, ids in enumerate(chunks):
        ((_, alone),) = compute_caches(tiny, [ids], context, 64)
        keys, values, _ = tiny.prefill(torch.tensor([context + ids]))  # L x [1, H_kv, P + T, D]
        assert packed[i].position == alone.position == len(context)
        for layer in range(alone.n_layers):
            for got, want, full in zip(packed[i].layer(layer), alone.layer(layer), (keys[layer], values[layer])):
                assert got.shape == want.shape == (2, len(ids), 16)  # [H_kv, T, D]
                # to rounding: on an AVX-512 machine (MKL 2024.2) packed and alone differed by up to 1.5e-7
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
                torch.testing.assert_close(got, full[0, :, len(context) :], atol=1e-5, rtol=0)


def test_a_packed_chunk_sees_nothing_of_the_chunks_beside_it(tiny):
    """Changing one chunk of a pack changes no other chunk's cache, and its own."""
    chunks = _chunks(3, (10, 14))
    changed = [chunks[0], tuple(t + 1 for t in chunks[1]), chunks[2]]
    before, after = (tiny.prefill_packed(c, tiny.prefill_packed([(101, 2023)])[0]) for c in (chunks, changed))
    for i in (0, 2):
        assert all(torch.equal(a, b) for a, b in zip(before[i][0] + before[i][1], after[i][0] + after[i][1]))
    assert not torch.equal(before[1][0][1], after[1][0][1])
    with pytest.raises(ValueError, match=rf"non-empty chunks, got lengths \[{len(chunks[0])}, 0\]"):
        tiny.prefill_packed([chunks[0], ()])


def test_index_stores_what_a_full_prefill_computes(tiny, docs, tmp_path):
    index = KVIndex.build(docs, tmp_path / "idx", CFG, adapter=tiny, progress=False)
    chunks = list(index.chunks.all_chunks())
    assert len({len(c.token_ids) for c in chunks}) > 1 and len(chunks) > 4  # several lengths
    prefix = torch.tensor([index.format.prefix_ids])
    for chunk in chunks:
        keys, values, _ = tiny.prefill(torch.cat([prefix, torch.tensor([chunk.token_ids])], 1))  # L x [1, H_kv, P+T, D]
        stored = index.store.get(index.addressing.key(chunk.token_ids))
        for layer in range(len(keys)):
            torch.testing.assert_close(stored.keys[layer], keys[layer][0, :, prefix.shape[1] :], atol=1e-5, rtol=0)
            torch.testing.assert_close(stored.values[layer], values[layer][0, :, prefix.shape[1] :], atol=1e-5, rtol=0)
        with safe_open(
            index.store.path(index.addressing.key(chunk.token_ids)), "pt"
        ) as f:  # a plain safetensors file too
            assert len(f.keys()) == 2 * len(keys) and torch.equal(f.get_tensor("v.1"), stored.values[1])


def test_write_behind_keeps_at_most_depth_pending_and_flushes(tiny, tmp_path):
    store = KVStore(tmp_path / "kv", CFG.index.codec, CFG.runtime.storage)
    chunks = _chunks(7, (8,))
    with WriteBehind(store, depth=2) as writer:
        for i, kv in compute_caches(tiny, chunks, (), 20):
            writer.put(f"{i:032x}", kv)
            assert len(writer._pending) <= 2
    assert all(store.get(f"{i:032x}") is not None for i in range(7))
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        WriteBehind(store, depth=0)


def test_write_behind_encodes_on_the_callers_thread_and_writes_on_its_own(tiny, tmp_path, monkeypatch):
    """The encoding is CPU work that must not preempt the compute's threads; the writes wait on the disk,
    which the compute must not. The stored entries are what `KVStore.put` stores."""
    store = KVStore(tmp_path / "kv", CFG.index.codec, CFG.runtime.storage)
    encoded_on, written_on = set(), set()

    def recording_encode(kv, codec):
        encoded_on.add(threading.get_ident())
        return encode_entry(kv, codec)

    def recording_write(key, data, cost=None, write=store.write):
        written_on.add(threading.get_ident())
        return write(key, data, cost)

    monkeypatch.setattr("rag_kvcache.indexing.precompute.encode_entry", recording_encode)
    monkeypatch.setattr(store, "write", recording_write)
    kvs = [kv for _, kv in compute_caches(tiny, _chunks(3, (8,)), (), 20)]
    with WriteBehind(store) as writer:
        for i, kv in enumerate(kvs):
            writer.put(f"{i:032x}", kv)
    assert encoded_on == {threading.get_ident()} and len(written_on) == 1 and written_on != encoded_on
    reference = KVStore(tmp_path / "ref", CFG.index.codec, CFG.runtime.storage)
    for i, kv in enumerate(kvs):
        reference.put(f"{i:032x}", kv)
        assert store.path(f"{i:032x}").read_bytes() == reference.path(f"{i:032x}").read_bytes()


def test_a_failed_background_write_fails_the_update_and_serves_no_cache_for_it(tiny, docs, tmp_path):
    """Fault injection: the store's folder for one chunk's cache is a file, so that write fails on the
    writer thread; the update raises it. Indexing is staged (the chunks committed, searchable, before their
    caches are made): the chunks stay, the failed cache is not served, and a re-run makes the missing caches."""
    index = KVIndex.create(tmp_path / "idx", CFG, adapter=tiny)
    from rag_kvcache.retrieval.chunking import chunk_document

    first = chunk_document(DOCS["doc3.txt"], "doc3.txt", tiny.tokenizer, CFG.index.chunk_tokens)[0].token_ids
    blocker = index.store.path(index.addressing.key(first)).parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        index.update(docs, progress=False)
    n_chunks = len(index.chunks)
    assert n_chunks > 0 and index.addressing.key(first) not in index.store
    blocker.unlink()
    report = index.update(docs, progress=False)  # re-run: resumes, the caches written before are kept
    assert report.new_chunks == [] and len(index.chunks) == n_chunks
    assert all(index.addressing.key(c.token_ids) in index.store for c in index.chunks.all_chunks())
