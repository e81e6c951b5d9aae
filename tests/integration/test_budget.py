"""The disk tier's byte budget (`store.ledger`): GDSF admission and eviction, shared by processes, recorded by the
store, and held under concurrent writers and after `kill -9`."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from filelock import FileLock

from rag_kvcache.config import StorageConfig
from rag_kvcache.store.addressing import address, cache_key
from rag_kvcache.store.kvstore import ChunkKV, KVStore
from rag_kvcache.store.ledger import _LOCK_FILE, Ledger
from rag_kvcache.store.opening import MADE_AT_USES


def make_kv(seed: int = 0, tokens: int = 5) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(
        [torch.randn(2, tokens, 8, generator=g) for _ in range(2)],
        [torch.randn(2, tokens, 8, generator=g) for _ in range(2)],
        0,
    )


def key(i: int) -> str:
    return cache_key("ns", (), (i,))


def entry_bytes(tmp_path) -> int:
    probe = KVStore(tmp_path / "probe", "none", StorageConfig(memory_bytes=0))
    probe.put(key(0), make_kv())
    return probe.path(key(0)).stat().st_size


def disk_bytes(store: KVStore) -> int:
    return sum(p.stat().st_size for p in store.root.glob("??/*.safetensors"))


def test_popular_entries_survive_a_stream_of_one_off_entries(tmp_path):
    size = entry_bytes(tmp_path)
    store = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=3 * size))
    hot = [key(i) for i in range(3)]
    for k in hot:
        assert store.put(k, make_kv())
    for _ in range(3):
        store.ledger.used({k: size for k in hot})
    for i in range(100, 120):  # each read once, then written: never above a hot entry's priority
        store.ledger.used({key(i): size})
        assert not store.put(key(i), make_kv(i))
    assert all(k in store for k in hot) and disk_bytes(store) <= 3 * size
    stats = store.ledger.stats()
    assert stats.refused == 20 and stats.hits == 9 and stats.misses == 20 and stats.entries == 3
    assert stats.hit_ratio == pytest.approx(9 / 29)
    assert {(k, uses, nbytes) for k, uses, nbytes, _ in stats.hot} == {(k, 3, size) for k in hot}


def test_an_entry_used_more_evicts_the_least_valuable(tmp_path):
    size = entry_bytes(tmp_path)
    store = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=2 * size))
    store.put(key(0), make_kv())
    store.put(key(1), make_kv())
    store.ledger.used({key(0): size})  # key(1) is now the least valuable
    store.ledger.used({key(2): size})
    store.ledger.used({key(2): size})  # key(2), missed twice, is worth more than key(1)
    assert store.put(key(2), make_kv(2))
    assert key(0) in store and key(1) not in store and key(2) in store
    assert store.ledger.stats().evictions == 1 and disk_bytes(store) <= 2 * size


def test_the_budget_is_the_stores_recorded_and_shrinking_it_evicts(tmp_path):
    size = entry_bytes(tmp_path)
    store = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=4 * size))
    for i in range(4):
        store.put(key(i), make_kv(i))
    store.ledger.used({key(3): size})
    again = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0))  # no budget given: the recorded one
    assert again.ledger.budget == 4 * size
    smaller = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=size))
    assert smaller.ledger.budget == size and disk_bytes(smaller) <= size and key(3) in smaller  # the used one stays


def test_files_without_rows_are_counted_and_rows_without_files_dropped(tmp_path):
    size = entry_bytes(tmp_path)
    store = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0))
    for i in range(3):
        store.put(key(i), make_kv(i))
    (tmp_path / "s" / "ledger.sqlite").unlink()  # an index made before the store had a ledger
    for extra in ("ledger.sqlite-wal", "ledger.sqlite-shm"):
        (tmp_path / "s" / extra).unlink(missing_ok=True)
    store.path(key(0)).unlink()
    again = KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=10 * size))
    assert again.ledger.keys() == {key(1), key(2)} and again.ledger.stats().bytes == 2 * size


def _writer(root, budget: int, worker: int, n: int) -> None:
    store = KVStore(root, "none", StorageConfig(memory_bytes=0, disk_bytes=budget))
    for i in range(n):
        k = key(1000 * worker + i)
        for _ in range(1 + i % 4):  # popularity to fight over: later keys evict the entries used less
            store.ledger.used({k: 1})
        store.put(k, make_kv(i))


def test_a_budget_of_a_few_entries_holds_under_concurrent_writers(tmp_path):
    size = entry_bytes(tmp_path)
    budget, root = 3 * size, tmp_path / "s"
    KVStore(root, "none", StorageConfig(memory_bytes=0, disk_bytes=budget))
    peak, done = [0], threading.Event()

    def on_disk() -> int:
        """Bytes of every file, a writer's temporary ones too, each inode once (a file renamed during the listing
        is seen under both names). A listing is not a snapshot: a file counted, then evicted for one listed later,
        would be counted with it, so the listing holds the admission lock; writes (of reserved bytes) go on."""
        sizes = {}
        with FileLock(root / _LOCK_FILE):
            for path in root.glob("??/*.safetensors"):
                try:
                    st = path.stat()
                except FileNotFoundError:  # renamed since the listing
                    continue
                sizes[st.st_ino] = st.st_size
        return sum(sizes.values())

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], on_disk())

    sampler = threading.Thread(target=sample)
    sampler.start()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, budget, w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    done.set()
    sampler.join()
    assert all(p.exitcode == 0 for p in procs)
    store = KVStore(root, "none", StorageConfig(memory_bytes=0))
    assert peak[0] <= budget and disk_bytes(store) <= budget
    assert store.ledger.keys() == {p.stem for p in root.glob("??/*.safetensors")}
    assert store.ledger.stats().evictions > 0  # the budget was fought over, not merely never reached


def _killed_mid_eviction(root, budget: int) -> None:
    store = KVStore(root, "none", StorageConfig(memory_bytes=0, disk_bytes=budget))
    store.ledger.used({key(99): 1})
    store.ledger.used({key(99): 1})
    real_unlink = type(root).unlink

    def unlink_then_die(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        os.kill(os.getpid(), signal.SIGKILL)  # the victim's file is gone, its row (in the open transaction) not

    type(root).unlink = unlink_then_die
    store.put(key(99), make_kv(99))


def test_kill_9_during_an_eviction_leaves_the_budget_held_and_the_ledger_true(tmp_path):
    size = entry_bytes(tmp_path)
    root = tmp_path / "s"
    store = KVStore(root, "none", StorageConfig(memory_bytes=0, disk_bytes=2 * size))
    store.put(key(0), make_kv(0))
    store.put(key(1), make_kv(1))
    store.ledger.close()
    proc = mp.get_context("spawn").Process(target=_killed_mid_eviction, args=(root, 2 * size))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert len(list(root.glob("??/*.safetensors"))) == 1  # one victim deleted, then the process died
    again = KVStore(root, "none", StorageConfig(memory_bytes=0))  # reconciles: the victim's row goes
    assert again.ledger.keys() == {p.stem for p in root.glob("??/*.safetensors")}
    assert again.ledger.stats().bytes == size
    again.ledger.used({key(99): 1})
    again.ledger.used({key(99): 1})
    assert again.put(key(99), make_kv(99)) and disk_bytes(again) <= 2 * size  # the lock died with its holder


def test_a_writer_killed_before_its_file_landed_frees_its_bytes(tmp_path):
    size = entry_bytes(tmp_path)
    root = tmp_path / "s"
    store = KVStore(root, "none", StorageConfig(memory_bytes=0, disk_bytes=2 * size))
    ledger = store.ledger
    child = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    assert ledger.reserve(key(5), size, 5)
    ledger._db.execute("UPDATE entries SET writer = ? WHERE key = ?", (child.pid, key(5)))  # reserved by a dead pid
    ledger.close()
    again = Ledger(root, store.path)
    assert again.keys() == set() and again.room() == 2 * size


def test_a_budget_below_zero_is_refused(tmp_path):
    with pytest.raises(ValueError, match="-5"):
        KVStore(tmp_path / "s", "none", StorageConfig(memory_bytes=0, disk_bytes=-5))


def test_cached_tokens_are_never_negative_when_a_cold_chunk_is_also_recomputed():
    """A chunk computed for the prompt (cold) whose first tokens the fusion recomputes too was counted twice, and
    cached tokens went negative: the server's metrics refused the count and the request failed with a 500."""
    from rag_kvcache.query.answers import Answer

    answer = Answer("a", "epic_match", 0.1, 0.0, 100, 40, 0.5, 0.0, 1, 2, cache_computed_tokens=80)
    assert answer.cached_tokens == 0 and answer.usage["cached_tokens"] == 0


def test_under_a_budget_every_cached_chunk_gets_both_its_caches(tiny, tmp_path):
    """A chunk's neighbour cache is computed behind its neighbours' behind-prefix caches. A neighbour outside the
    hot set has none stored: the one made for the neighbour pass was stored, took the room the budget had planned
    for the hot set's neighbour caches, and the pass stopped with chunks holding only their behind-prefix cache.
    Now it is kept in memory, and the hot set's estimate counts the files' headers and the prefix's cache."""
    from test_cached_neighbours import CACHED, write_docs

    from rag_kvcache.index import KVIndex

    write_docs(tmp_path / "docs")
    whole = KVIndex.build(tmp_path / "docs", tmp_path / "whole", CACHED, adapter=tiny, progress=False)
    n_chunks, whole_bytes = len(whole.chunks), disk_bytes(whole.store)
    whole.close()
    budget = whole_bytes // 2
    index = KVIndex.build(
        tmp_path / "docs", tmp_path / "idx", CACHED.with_storage(disk_bytes=budget), adapter=tiny, progress=False
    )
    maker, on_disk = index.maker, {p.stem for p in index.store.root.glob("??/*.safetensors")}
    held = [[key in on_disk for key in maker.chunk_keys(c.token_ids)] for c in index.chunks.all_chunks()]
    assert all(all(h) or not any(h) for h in held)  # a cached chunk has both its caches, the others none
    cached = sum(all(h) for h in held)
    assert 0 < cached < n_chunks and disk_bytes(index.store) <= budget
    one_more = max(maker.disk_bytes([len(c.token_ids)]) for c in index.chunks.all_chunks())  # a chunk's two caches
    assert budget - disk_bytes(index.store) < 2 * one_more  # the room went to the hot set, not left unused


def test_indexing_under_a_budget_a_few_chunks_at_a_time_makes_the_index_the_whole_corpus_at_once_makes(
    tiny, tmp_path, monkeypatch
):
    """The passes over the corpus after its chunks are committed (the hot set's ranking, the chunks lacking
    neighbour caches, their neighbours' searches) held every chunk's record, and the live caches every chunk's
    neighbour contexts: over 100 bytes a token. They now read the corpus a batch at a time (`maker.BATCH`, the
    hot set `maker.HOT_BATCH`); an index built two chunks at a time holds the caches and neighbour table that one
    built with the whole corpus in one batch holds."""
    from test_cached_neighbours import CACHED, write_docs

    from rag_kvcache.index import KVIndex
    from rag_kvcache.indexing import maker
    from rag_kvcache.indexing.neighbours import NeighbourTable

    write_docs(tmp_path / "docs")
    whole = KVIndex.build(tmp_path / "docs", tmp_path / "whole", CACHED, adapter=tiny, progress=False)
    budget = disk_bytes(whole.store) // 2
    whole.close()
    built = {}
    for name, batch in (("one", 10**6), ("small", 2)):
        monkeypatch.setattr(maker, "BATCH", batch)
        monkeypatch.setattr(maker, "HOT_BATCH", max(batch // 2, 1))
        index = KVIndex.build(
            tmp_path / "docs", tmp_path / name, CACHED.with_storage(disk_bytes=budget), adapter=tiny, progress=False
        )
        assert len(index.chunks) > 2 * batch or batch > len(index.chunks)
        files = {p.stem for p in index.store.root.glob("??/*.safetensors")}
        built[name] = files, dict(NeighbourTable(index.path)), index.maker.live_keys()
        index.close()
    assert built["small"] == built["one"] and built["one"][0] and len(built["one"][1]) > 0


def test_under_a_budget_a_chunk_without_a_cache_is_computed_where_it_stands(tiny, tmp_path):
    """Under a budget a retrieved chunk outside the hot set has no cache by design. It was made behind the system
    prefix in the request (a forward more while the prompt waits) and then fused like a cached chunk, and on the
    planted questions the default lost facts a full prefill answers. Now its segment is computed where it stands
    by the prompt's prefill, as `full` computes it, nothing is stored while the prompt waits, and its caches are
    asked of `backfill` (made off the request path if the budget admits them): a prompt none of whose chunks has
    a cache answers as `full`."""
    from test_cached_neighbours import CACHED, write_docs

    from rag_kvcache.config import FusionConfig
    from rag_kvcache.index import KVIndex
    from rag_kvcache.query.generator import FusedGenerator

    write_docs(tmp_path / "docs")
    index = KVIndex.build(
        tmp_path / "docs", tmp_path / "idx", CACHED.with_storage(disk_bytes=1), adapter=tiny, progress=False
    )
    assert not list(index.store.root.glob("??/*.safetensors"))  # a budget of a byte keeps no cache
    question = "Who kept the lighthouse diary of ships?"
    hits = index.search(question, 3)
    fmt = index.format
    segments = fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(tiny.tokenizer, question))
    gen = FusedGenerator(index)
    fused = gen.fuse(segments, FusionConfig(method="epic_match"))
    full = gen.fuse(segments, FusionConfig(method="full"))
    torch.testing.assert_close(fused.result.logits, full.result.logits, atol=1e-4, rtol=0)
    assert fused.cache_misses >= len(hits) and fused.result.recomputed_tokens == full.result.recomputed_tokens
    assert fused.cache_computed_tokens == 0  # no cache was made for it: the prefill computed its tokens
    assert not list(index.store.root.glob("??/*.safetensors"))  # nothing written while the prompt waited
    first = index.addressing.key(hits[0].chunk.token_ids, fmt.prefix_ids)  # behind the prefix, as it stands
    means = {key for h in hits[1:] for key, _ in index.addressing.neighbour_reads(h.chunk.token_ids)}
    assert {first} | means <= set(index.caches.wanted)  # what the default reads, made later if the budget admits
    assert index.caches.backfill(limit=len(index.caches.wanted)) == 0  # a byte admits none


def cold_index(tiny, tmp_path):
    """An index of the test documents that holds no cache (built with a budget of a byte), opened with room for
    every cache; the hits of a question and its prompt's segments."""
    from test_cached_neighbours import CACHED, write_docs

    from rag_kvcache.index import KVIndex

    write_docs(tmp_path / "docs")
    KVIndex.build(
        tmp_path / "docs", tmp_path / "idx", CACHED.with_storage(disk_bytes=1), adapter=tiny, progress=False
    ).close()
    index = KVIndex.open(tmp_path / "idx", CACHED.with_storage(disk_bytes=10**9), adapter=tiny)
    question = "Who kept the lighthouse diary of ships?"
    hits = index.search(question, 3)
    fmt = index.format
    return index, hits, fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(tiny.tokenizer, question))


def test_a_first_chunk_computed_in_place_is_stored_as_the_prompt_computed_it(tiny, tmp_path):
    """Under a budget, a chunk without a cache is computed where it stands (above), and `backfill` then made its
    behind-prefix cache with a forward of its own, which in an unbroken stream the next request waited for. Where
    the chunk stands right behind the system prefix, the prompt's K/V over it are that cache: they are kept for
    `backfill` to store instead, and the chunks further in (behind other chunks) are still made."""
    from rag_kvcache.config import FusionConfig
    from rag_kvcache.query.generator import FusedGenerator

    index, hits, segments = cold_index(tiny, tmp_path)
    fmt = index.format
    for _ in range(MADE_AT_USES):  # read so often, the chunks' neighbour caches are made too
        FusedGenerator(index).fuse(segments, FusionConfig(method="epic_match"))
    first = hits[0].chunk.token_ids
    first_key = index.addressing.key(first, fmt.prefix_ids)
    prefix_key = index.addressing.key(fmt.prefix_ids, ())  # a byte's budget kept not even the prefix's cache
    assert set(index.caches.ready) == {prefix_key, first_key}  # the chunks after it were behind other chunks
    kept = index.caches.ready[first_key]
    made = index.maker.make(first, (fmt.prefix_ids,))  # as `backfill` made it
    assert kept.position == made.position == len(fmt.prefix_ids) and kept.n_layers == made.n_layers
    for layer in range(made.n_layers):
        for got, want in zip(kept.layer(layer), made.layer(layer)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    forwards: list[tuple[int, ...]] = []
    make = index.maker.make

    def counted(ids, contexts, pause=None):
        forwards.append(tuple(ids))
        return make(ids, contexts, pause)

    index.maker.make = counted
    wanted = set(index.caches.wanted)
    assert index.caches.backfill(limit=len(wanted)) == len(wanted)  # the budget admits every one
    assert prefix_key in index.store and first_key in index.store and not index.caches.ready
    assert len(forwards) == len(wanted) - 2 and first not in forwards  # all but the kept ones were made
    stored = index.store.get(first_key)
    torch.testing.assert_close(stored.layer(0)[0], kept.layer(0)[0])
    index.close()


def test_a_chunk_outside_the_hot_set_gets_its_neighbour_cache_once_a_prompt_reads_it(tiny, tmp_path):
    """Under a budget only the hot set's neighbours were recorded, so a chunk outside it never had a neighbour
    cache: once `backfill` had stored its behind-prefix cache, every prompt read that cache alone wherever the chunk
    stood (the path that lost planted facts), though the default reads a chunk after the first behind its
    neighbours. Now indexing names every chunk's neighbours, and a prompt that reads one after another chunk asks
    `backfill` for its neighbour cache too: the next prompt reads the caches the default reads."""
    from rag_kvcache.config import FusionConfig
    from rag_kvcache.query.generator import FusedGenerator

    index, hits, segments = cold_index(tiny, tmp_path)
    chunks = list(index.chunks.all_chunks())
    assert all(index.addressing.near(c.token_ids) for c in chunks)  # no chunk has a cache, each its neighbours
    gen = FusedGenerator(index)
    for _ in range(MADE_AT_USES):  # read so often, the chunks' neighbour caches are made
        gen.fuse(segments, FusionConfig(method="epic_match"))
    later = [h.chunk.token_ids for h in hits[1:]]  # read after another chunk: behind their neighbours
    means = {key for ids in later for key, _ in index.addressing.neighbour_reads(ids)}
    assert means and means <= set(index.caches.wanted)
    wanted = len(index.caches.wanted)
    assert index.caches.backfill(limit=wanted) == wanted  # the budget admits every one
    assert all(key in index.store for key in means)
    assert means <= {key for at in address(index.addressing, segments) for key in at.keys}  # what prompts read now
    again = gen.fuse(segments, FusionConfig(method="epic_match"))
    assert again.cache_misses == 0 and not index.caches.wanted
    index.close()


def test_under_a_budget_a_neighbour_cache_is_made_on_its_second_read(tiny, tmp_path):
    """Under a budget, with every chunk's neighbours recorded, `backfill` made each chunk's neighbour cache after
    the first prompt that read the chunk after another one: a forward behind the neighbours' caches (and theirs,
    where the store holds none) that the next request of an unbroken stream waited for, though a chunk outside the
    hot set is mostly read once. Now it is made once prompts have read it `MADE_AT_USES` times. Meanwhile a prompt
    computes the chunk where it stands, as `full` does: it read the chunk's cache behind the prefix alone in its
    place, the reading that lost planted facts the default keeps."""
    from rag_kvcache.config import FusionConfig
    from rag_kvcache.query.generator import FusedGenerator

    index, hits, segments = cold_index(tiny, tmp_path)
    first = index.addressing.own_key(hits[0].chunk.token_ids)  # read behind the prefix: its own cache
    later = [h.chunk.token_ids for h in hits[1:]]
    means = {key for ids in later for key, _ in index.addressing.neighbour_reads(ids)}
    own_later = {index.addressing.own_key(ids) for ids in later}  # their caches behind the prefix alone
    gen = FusedGenerator(index)
    gen.fuse(segments, FusionConfig(method="epic_match"))
    assert {first} | means <= set(index.caches.wanted)  # and the system prefix's
    index.caches.backfill(limit=len(index.caches.wanted))
    assert first in index.store and not any(key in index.store for key in means | own_later)
    assert not index.caches.wanted  # a neighbour cache read once is dropped: read again, it is wanted again
    opened = index.caches.open(segments, in_place=True)
    chunks = [i for i, seg in enumerate(segments) if seg.label.startswith("chunk")]
    assert opened.sources[chunks[0]] is not None  # the first chunk: its cache behind the prefix
    assert all(opened.sources[i] is None for i in chunks[1:])  # the others computed in the prompt
    again = gen.fuse(segments, FusionConfig(method="epic_match"))
    assert again.cache_misses == len(later) and set(index.caches.wanted) == means
    assert not any(key in index.store for key in own_later)  # no cache behind the prefix alone made for them
    assert index.caches.backfill(limit=len(means)) == len(means)  # read twice: made
    assert all(key in index.store for key in means)
    assert gen.fuse(segments, FusionConfig(method="epic_match")).cache_misses == 0
    index.close()
