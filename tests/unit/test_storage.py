"""Storage tiers: layer-wise reads, memory promotion, LRU/LFU eviction by bytes, counters, codecs,
and the pipelined layer feed."""

from __future__ import annotations

import pytest
import torch
from test_kvstore import make_kv

from rag_kvcache.config import CODEC_NAMES, StorageConfig
from rag_kvcache.engine.fusion import FusionInput, KVPlacement
from rag_kvcache.store.backend import Entry
from rag_kvcache.store.codecs import CODECS, get_codec
from rag_kvcache.store.kvstore import KVStore
from rag_kvcache.store.loading import LayerFeed
from rag_kvcache.store.tiers import ChunkKV, EvictionPolicy, MemoryTier

KEYS = [f"{i:02x}" * 16 for i in range(6)]


def test_one_layer_is_read_without_the_others(tmp_path):
    store = KVStore(tmp_path, "none", StorageConfig(memory_bytes=0))
    kv = make_kv(layers=4, tokens=6)
    store.put(KEYS[0], kv)
    entry = store.open(KEYS[0])
    assert isinstance(entry, Entry) and (entry.n_layers, entry.n_tokens, entry.position) == (4, 6, 7)
    k, v = entry.layer(2)
    assert torch.equal(k, kv.keys[2]) and torch.equal(v, kv.values[2])
    layer_bytes = kv.keys[2].nbytes + kv.values[2].nbytes
    assert store.disk.stats.bytes_read == layer_bytes  # exactly one layer's bytes were touched


def test_memory_tier_serves_entries_read_whole(tmp_path):
    store = KVStore(tmp_path, "none", StorageConfig(memory_bytes=1 << 20))
    kv = make_kv()
    store.put(KEYS[0], kv)
    assert len(store.memory) == 0  # writes do not fill the read cache
    store.get(KEYS[0])
    assert isinstance(store.open(KEYS[0]), ChunkKV)
    stats = store.stats()
    assert (stats["disk"].hits, stats["memory"].misses, stats["memory"].hits) == (1, 1, 1)


@pytest.mark.parametrize("kind, survivor", [("lru", KEYS[0]), ("lfu", KEYS[0])])
def test_memory_tier_evicts_by_bytes(tmp_path, kind, survivor):
    kv = make_kv()
    store = KVStore(tmp_path, "none", StorageConfig(memory_bytes=2 * kv.nbytes, eviction=kind))
    for key in KEYS[:2]:
        store.put(key, kv)
        store.get(key)
    store.get(KEYS[0])  # KEYS[0] now most recent (lru) and most used (lfu)
    store.put(KEYS[2], kv)
    store.get(KEYS[2])
    assert store.memory.nbytes <= 2 * kv.nbytes and store.memory.stats.evictions == 1
    assert isinstance(store.open(survivor), ChunkKV) and not isinstance(store.open(KEYS[1]), ChunkKV)


def test_lfu_and_lru_differ():
    lru, lfu = EvictionPolicy("lru"), EvictionPolicy("lfu")
    for policy in (lru, lfu):
        policy.add("a", 10)
        for _ in range(3):
            policy.touch("a")
        policy.add("b", 10)  # b is the most recent, a the most used
    assert lru.victims(10) == ["a"] and lfu.victims(10) == ["b"]
    with pytest.raises(ValueError, match="'mru'"):
        EvictionPolicy("mru")


def test_counters_persist_across_processes(tmp_path):
    store = KVStore(tmp_path, "none")
    store.put(KEYS[0], make_kv())
    store.get(KEYS[0])
    store.get(KEYS[1])
    store.flush_stats()
    again = KVStore(tmp_path, "none")
    again.get(KEYS[0])  # served by disk: the new process's memory tier is empty
    stats = again.stats()
    assert stats["disk"].hits == 2 and stats["disk"].misses == 1 and stats["disk"].bytes_written > 0


@pytest.mark.parametrize(
    "codec, tol", [("int8-channel", 0.02), ("int8-token", 0.02), ("fp8", 0.08), ("int8k-int4v", 0.07)]
)
def test_compressed_codecs_round_trip_smaller(tmp_path, codec, tol):
    kv = make_kv(layers=2, tokens=64)
    raw = KVStore(tmp_path / "raw", "none", StorageConfig(memory_bytes=0))
    packed = KVStore(tmp_path / codec, codec, StorageConfig(memory_bytes=0))
    raw.put(KEYS[0], kv)
    packed.put(KEYS[0], kv)
    for store in (raw, packed):  # what the codec says it stores is the file, but for its header
        payload = 2 * sum(store.codec.of(kind).nbytes(2, 64, 8, torch.float32) for kind in "kv")  # 2 layers
        assert 0 < store.path(KEYS[0]).stat().st_size - payload < 2048
    # head_dim 8 here: a per-token fp32 scale costs half as much as the int8 payload (1/16 at head_dim 64)
    assert packed.path(KEYS[0]).stat().st_size < 0.45 * raw.path(KEYS[0]).stat().st_size
    got = packed.get(KEYS[0])
    for a, b in zip(got.keys + got.values, kv.keys + kv.values):
        assert a.dtype == b.dtype and ((a - b).abs().max() / b.abs().max()).item() < tol
    # the file says how it is stored: a store configured otherwise still reads it
    assert torch.equal(raw.disk.open(KEYS[0]).layer(0)[0], kv.keys[0])
    assert KVStore(tmp_path / codec, "none", StorageConfig(memory_bytes=0)).get(KEYS[0]) is not None


@pytest.mark.parametrize("codec, channels", [("int8-channel", 3), ("int8-token", 3), ("fp8", 3), ("int8k-int4v", 4)])
def test_a_layer_is_one_read_and_decodes_like_the_codec(tmp_path, codec, channels):
    """A layer's parts (payload and side data) come back from one byte range, each verified, decoded as
    the codec decodes them; 3 tokens of 3 channels (of 4 for 4-bit values: 6 bytes of them) put the float32
    scales at offsets a typed view cannot start at, which must not matter."""
    g = torch.Generator().manual_seed(1)
    kv = ChunkKV(*([torch.randn(1, 3, channels, generator=g) for _ in range(2)] for _ in "kv"), 1)  # not at the start
    store = KVStore(tmp_path, codec, StorageConfig(memory_bytes=0))
    store.put(KEYS[0], kv)
    k, v = store.open(KEYS[0]).layer(1)
    c = get_codec(codec)
    assert torch.equal(k, c.of("k").decode(c.of("k").encode(kv.keys[1]), torch.float32))
    assert torch.equal(v, c.of("v").decode(c.of("v").encode(kv.values[1]), torch.float32))
    layer_bytes = sum(c.of(kind).nbytes(1, 3, channels, torch.float32) for kind in "kv")
    assert store.disk.stats.bytes_read == layer_bytes  # the layer's bytes, once


def test_4_bit_values_two_a_byte_within_half_a_step():
    """int8k-int4v stores keys as int8-channel does, bit for bit, and values at 16 levels per channel between
    the channel's low and high ends: each element within half a level of its value, both ends exact, channel i
    in a byte's low nibble and channel i + D / 2 in its high one. An odd head_dim cannot be packed: refused, named."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(2, 40, 6, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0, 5.0]) + 2.0  # [H, T, D]
    split, int8 = get_codec("int8k-int4v"), get_codec("int8-channel")
    assert torch.equal(
        split.of("k").decode(split.of("k").encode(t), torch.float32),
        int8.of("k").decode(int8.of("k").encode(t), torch.float32),
    )
    values = split.of("v")
    parts = values.encode(t)
    assert parts[""].dtype == torch.uint8 and tuple(parts[""].shape) == (2, 40, 3)
    back = values.decode(parts, torch.float32)
    step = (t.amax(1, keepdim=True) - t.amin(1, keepdim=True)) / 15  # [H, 1, D]
    assert ((back - t).abs() <= step / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(back.amin(1), t.amin(1))
    torch.testing.assert_close(back.amax(1), t.amax(1))
    levels = ((t - t.amin(1, keepdim=True)) / step).round().to(torch.uint8)  # [H, T, D]
    assert torch.equal(parts[""] & 15, levels[..., :3]) and torch.equal(parts[""] >> 4, levels[..., 3:])
    assert values.nbytes(2, 40, 6, torch.float32) == parts[""].nbytes + parts["scale"].nbytes + parts["low"].nbytes
    with pytest.raises(ValueError, match=r"even head_dim.*\(2, 40, 5\)"):
        values.encode(t[..., :5])


def test_4_bit_values_take_their_range_per_group_of_64_tokens():
    """Over a 150-token cache the values' ranges are those of tokens 0-63, 64-127 and 128-149: each element within
    half a level of its own group's range, each group's ends exact; decoded into a buffer of float32 or of another
    dtype as decoded alone. A cache stored with one range for all its tokens (an index built before groups) reads
    back as stored."""
    from rag_kvcache.store.codecs import Packed4

    g = torch.Generator().manual_seed(4)
    t = torch.randn(2, 150, 6, generator=g) * torch.linspace(0.1, 20.0, 150)[:, None]  # [H, T, D], ranges grow
    values = get_codec("int8k-int4v").of("v")
    parts = values.encode(t)
    assert tuple(parts["scale"].shape) == tuple(parts["low"].shape) == (2, 3, 6)
    back = values.decode(parts, torch.float32)
    for group in (slice(0, 64), slice(64, 128), slice(128, 150)):
        x, y = t[:, group], back[:, group]  # [H, n, D]
        step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 15  # [H, 1, D]
        assert ((y - x).abs() <= step / 2 * (1 + 1e-5)).all()
        torch.testing.assert_close(y.amin(1), x.amin(1))
        torch.testing.assert_close(y.amax(1), x.amax(1))
    assert torch.equal(values.decode(parts, torch.float32, out=torch.empty(2, 150, 6)), back)
    assert torch.equal(
        values.decode(parts, torch.bfloat16, out=torch.empty(2, 150, 6, dtype=torch.bfloat16)), back.bfloat16()
    )
    assert values.nbytes(2, 150, 6, torch.float32) == sum(p.nbytes for p in parts.values())
    whole = Packed4(group=150).encode(t)  # one range per channel over all 150 tokens
    assert tuple(whole["scale"].shape) == (2, 1, 6)
    assert torch.equal(values.decode(whole, torch.float32), Packed4(group=150).decode(whole, torch.float32))
    assert (back - t).abs().mean() < 0.75 * (values.decode(whole, torch.float32) - t).abs().mean()


def test_an_entry_at_a_sequences_start_keeps_its_values_at_8_bits(tmp_path):
    """The system prefix's cache holds the attention sink, whose outlier values 4 bits per channel cannot hold
    (at 4 bits they moved the fused answers' teacher-forced KL by +29%): int8k-int4v stores the values of an
    entry at position 0 as int8-channel does, those of any other entry at 4 bits, and each reads back as stored
    (the entry's header says its position); `cache_nbytes` counts each as stored."""
    from rag_kvcache.engine.interface import KVLayout
    from rag_kvcache.store.codecs import cache_nbytes

    g = torch.Generator().manual_seed(3)
    tensors = [[torch.randn(2, 64, 8, generator=g) for _ in range(2)] for _ in "kv"]
    store = KVStore(tmp_path, "int8k-int4v", StorageConfig(memory_bytes=0))
    int8, split = get_codec("int8-channel"), get_codec("int8k-int4v")
    layout = KVLayout(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    for key, position, values in ((KEYS[0], 0, int8.of("v")), (KEYS[1], 7, split.of("v"))):
        store.put(key, ChunkKV(*tensors, position))
        k, v = store.open(key).layer(1)
        assert torch.equal(v, values.decode(values.encode(tensors[1][1]), torch.float32))
        assert torch.equal(k, int8.of("k").decode(int8.of("k").encode(tensors[0][1]), torch.float32))
        stored = store.path(key).stat().st_size - cache_nbytes(split, layout, [64], position)
        assert 0 < stored < 2048  # the header
    assert cache_nbytes(split, layout, [64], 0) == cache_nbytes(int8, layout, [64], 0)
    assert store.path(KEYS[1]).stat().st_size < store.path(KEYS[0]).stat().st_size


def test_every_codec_name_the_config_accepts_is_implemented():
    assert tuple(CODECS) == CODEC_NAMES


def test_unknown_codec_and_bad_storage_config():
    with pytest.raises(ValueError, match="'int4'"):
        get_codec("int4")
    with pytest.raises(ValueError, match="-1"):
        StorageConfig(prefetch_layers=-1)
    with pytest.raises(ValueError, match="'mru'"):
        StorageConfig(eviction="mru")


def test_page_cache_can_be_dropped(tmp_path):
    store = KVStore(tmp_path, "none", StorageConfig(memory_bytes=0))
    store.put(KEYS[0], make_kv())
    store.disk.drop_page_cache()
    assert store.get(KEYS[0]) is not None


class _Slow:
    """A layer source that records the order of reads."""

    def __init__(self, kv: ChunkKV, log: list[int]) -> None:
        self.kv, self.log, self.position = kv, log, kv.position

    n_tokens = property(lambda self: self.kv.n_tokens)
    n_layers = property(lambda self: self.kv.n_layers)

    def layer(self, i):
        self.log.append(i)
        return self.kv.layer(i)


def _layout(kv: ChunkKV, after: int) -> KVPlacement:
    """Where a prompt of `kv`'s tokens (at their cached positions) and `after` uncached ones puts the cache."""
    h_kv, n, d = kv.keys[0].shape
    return KVPlacement((2, h_kv, n + after, d), kv.keys[0].dtype, torch.arange(n), ((0, 0, n),), (0,))


def test_feed_reads_ahead_in_order_and_stops_when_closed():
    kv = make_kv(layers=6)
    seen: list[int] = []
    feed = LayerFeed([_Slow(kv, seen), None], _layout(kv, 3), n_layers=6, depth=2)
    k, v = feed.get(0)  # the prompt's layer [H_kv, N, D]: the cache in place, the uncached tokens left to the fusion
    n = kv.n_tokens
    assert torch.equal(k[:, :n], kv.keys[0]) and torch.equal(v[:, :n], kv.values[0]) and k.shape[1] == n + 3
    assert torch.equal(feed.get(1)[0, :, :n], kv.keys[1])
    with pytest.raises(ValueError, match="in order"):
        feed.get(3)
    feed.close()
    assert seen == sorted(seen) and len(seen) < 6  # it read ahead, but not past what the queue holds


def test_feed_hands_reader_errors_to_the_consumer():
    class Broken(_Slow):
        def layer(self, i):
            raise OSError("device gone")

    feed = LayerFeed([Broken(make_kv(), [])], _layout(make_kv(), 1), n_layers=3, depth=1)
    with pytest.raises(OSError, match="device gone"):
        feed.get(0)


def test_prefetching_feed_fuses_like_reading_on_demand(tiny):
    from rag_kvcache.config import FusionConfig
    from rag_kvcache.engine.methods import get_method
    from rag_kvcache.engine.prompt import Segment

    g = torch.Generator().manual_seed(1)
    chunks = [tuple(torch.randint(1000, 2000, (12,), generator=g).tolist()) for _ in range(3)]
    segments = [Segment(c, cacheable=True, label=f"c{i}") for i, c in enumerate(chunks)]
    segments.append(Segment((2054, 2003, 1029), cacheable=False, label="question"))
    caches = []
    for c in chunks:
        keys, values, _ = tiny.prefill(torch.tensor([c]))
        caches.append(ChunkKV([k[0] for k in keys], [v[0] for v in values], 0))
    contexts = [()] * 3
    inp = FusionInput.build(segments, caches + [None], contexts + [()])
    direct = get_method("cacheblend")(tiny, inp, FusionConfig(ratio=0.3))
    with LayerFeed(inp.sources, inp.placement(tiny), tiny.layout.n_layers, depth=2) as feed:
        fed = get_method("cacheblend")(tiny, inp, FusionConfig(ratio=0.3), reader=feed)
    assert fed.stages["kv_wait"] >= 0
    torch.testing.assert_close(direct.logits, fed.logits, atol=0, rtol=0)
    for a, b in zip(direct.keys + direct.values, fed.keys + fed.values):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_counters_taken_while_a_reader_counts_lose_nothing(tmp_path):
    """The fusion's background reader counts hits while the query thread flushes: no count is lost."""
    import threading

    store = KVStore(tmp_path, "none", StorageConfig(memory_bytes=0))
    store.put("a" * 32, make_kv())
    stop = threading.Event()
    opened = []

    def reader() -> None:
        while not stop.is_set():
            opened.append(store.open("a" * 32) is not None)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(20):
        store.flush_stats()
    stop.set()
    thread.join()
    store.flush_stats()
    assert store.stats()["disk"].hits == sum(opened) > 0


def test_a_memory_tier_is_pinned_only_in_host_memory():
    with pytest.raises(ValueError, match="pinned memory tier holds host memory, not meta"):
        MemoryTier(1 << 20, "lru", "meta", pinned=True)


@pytest.mark.parametrize("method", ["reuse", "cacheblend"])
def test_assembling_every_layer_at_once_fuses_like_reading_each_layer(tiny, method):
    """`WholeReader` (caches in memory: every layer placed at once, the moved keys rotated per run of
    segments) gives the fusion the K/V `DirectReader` gives it layer by layer, bit for bit: over a stacked
    cache, a slice of one and a cache of separate layers, each moved from where it was computed."""
    from rag_kvcache.config import FusionConfig
    from rag_kvcache.engine.cache import SliceKV, all_layers, resident
    from rag_kvcache.engine.fusion import DirectReader, WholeReader
    from rag_kvcache.engine.methods import get_method
    from rag_kvcache.engine.prompt import Segment

    g = torch.Generator().manual_seed(2)
    chunks = [tuple(torch.randint(1000, 2000, (n,), generator=g).tolist()) for n in (12, 9, 15)]
    caches = []
    for c in chunks:
        keys, values, _ = tiny.prefill(torch.tensor([c]))
        whole = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(keys, values)])  # [L, 2, H_kv, T, D]
        caches.append(ChunkKV.viewing(whole, 0))
    plain = ChunkKV([k.clone() for k in caches[1].keys], [v.clone() for v in caches[1].values], 0)
    part = SliceKV(caches[2], 3, 11)  # a run of the third chunk's tokens
    sources = [caches[0], plain, part, None]
    segments = [
        Segment(chunks[0], cacheable=True, label="c0"),
        Segment(chunks[1], cacheable=True, label="c1"),
        Segment(chunks[2][3:11], cacheable=True, label="c2", whole=chunks[2], offset=3),
        Segment((2054, 2003, 1029), cacheable=False, label="question"),
    ]
    assert all(map(resident, sources))
    assert all_layers(caches[0]).data_ptr() == caches[0].keys[0].data_ptr()  # a view, not a copy
    torch.testing.assert_close(all_layers(part)[:, 0], torch.stack([k[:, 3:11] for k in caches[2].keys]))
    inp = FusionInput.build(segments, sources, [()] * 4)
    placement = inp.placement(tiny)
    assert placement.cos is not None  # the segments after the first are moved
    cfg = FusionConfig(ratio=0.3)
    direct = get_method(method)(tiny, inp, cfg, reader=DirectReader(inp.sources, placement))
    whole = get_method(method)(tiny, inp, cfg, reader=WholeReader(inp.sources, placement, tiny.layout.n_layers))
    torch.testing.assert_close(direct.logits, whole.logits, atol=0, rtol=0)
    for a, b in zip(direct.keys + direct.values, whole.keys + whole.values):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_cache_read_whole_is_held_in_memory_stacked(tmp_path, codec):
    """An entry read whole enters the memory tier as one stacked tensor, decoded into it layer by layer (no
    copy when the last layer is read), so a prompt over it is assembled with one copy a cache
    (`cache.all_layers` is a view); its layers are what reading the entry without a memory tier decodes."""
    from rag_kvcache.engine.cache import all_layers

    store = KVStore(tmp_path, codec, StorageConfig())
    store.put(KEYS[0], make_kv())
    entry = store.open(KEYS[0])
    assert isinstance(entry, Entry)
    read = [entry.layer(i) for i in range(entry.n_layers)]
    held = store.open(KEYS[0])
    assert isinstance(held, ChunkKV) and held.stacked is not None
    assert all_layers(held).data_ptr() == held.keys[0].data_ptr() == read[0][0].data_ptr()
    plain = KVStore(tmp_path, codec, StorageConfig(memory_bytes=0)).open(KEYS[0])  # no tier to promote to
    assert isinstance(plain, Entry)
    for i, (k, v) in enumerate(read):
        torch.testing.assert_close(torch.stack([k, v]), torch.stack(plain.layer(i)), atol=0, rtol=0)


def test_a_prompt_whose_caches_are_in_memory_is_assembled_at_once_and_fuses_as_when_read(tiny, tmp_path, monkeypatch):
    """The first ask of a prompt reads its caches from disk through the feed; the second finds them in the
    memory tier and assembles every layer at once (`WholeReader`): the same fused prompt, bit for bit."""
    from test_cached_neighbours import write_docs

    import rag_kvcache.query.generator as generator
    from rag_kvcache.config import Config, FusionConfig, IndexSettings, QueryConfig
    from rag_kvcache.index import KVIndex

    write_docs(tmp_path / "docs")
    config = Config(index=IndexSettings(chunk_tokens=24), query=QueryConfig(top_k=3))
    index = KVIndex.build(tmp_path / "docs", tmp_path / "idx", config, adapter=tiny, progress=False)
    question = "Who kept the diary?"
    segments = index.format.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], index.format.question_ids(tiny.tokenizer, question)
    )
    made = []
    real = generator.WholeReader
    monkeypatch.setattr(generator, "WholeReader", lambda *args: made.append(args) or real(*args))
    gen = generator.FusedGenerator(index)
    for method in ("reuse", "epic"):
        for key in index.maker.live_keys():
            index.store.memory.remove(key)
        made.clear()
        cold = gen.fuse(segments, FusionConfig(method=method)).result
        assert made == []  # read from disk, layer by layer
        warm = gen.fuse(segments, FusionConfig(method=method)).result
        assert len(made) == 1
        torch.testing.assert_close(cold.logits, warm.logits, atol=0, rtol=0)
        for a, b in zip(cold.keys + cold.values, warm.keys + warm.values):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
