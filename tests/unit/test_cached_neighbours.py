"""`chunk_prefill="cached_neighbours"` (issue 33): a chunk's cache behind its N most similar chunks, computed
behind the neighbours' *cached* K/V (re-rotated to where they sit in the context) instead of their recomputed
text. Exact where the cached context is exact (one neighbour: its behind-prefix cache is its own, right after
the prefix); inexact in general, so stored under keys of its own. The index stores it averaged with the chunk's
behind-prefix cache (the mean a query reads); an index built before session 40 stores it alone, and a query
averages the two."""

from __future__ import annotations

import errno
import logging
from dataclasses import replace

import pytest
import torch
from test_fusion import ATOL, rerotate
from test_methods_neighbours import DOCS

from rag_kvcache.config import Config, FusionConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.cache import BlendKV, ChunkKV, LayerSource
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.errors import StorageFullError
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.neighbours import NeighbourTable, drop
from rag_kvcache.indexing.precompute import cached_context, compute_behind_cached, compute_caches
from rag_kvcache.indexing.provenance import STORED_MEANS_KEY
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.store.addressing import CacheAddressing, address

# caches stored as computed: the exactness checks compare K/V to float tolerance
CACHED = Config(
    index=IndexSettings(chunk_tokens=24, chunk_prefill="cached_neighbours", context_chunks=2, codec="none"),
    query=QueryConfig(top_k=3),
)


def write_docs(folder) -> None:
    folder.mkdir(exist_ok=True)
    for name, text in DOCS.items():
        (folder / name).write_text(text)


@pytest.fixture(params=["tiny", "bpe_tiny"])
def model(request):
    """The tiny model under MiniLM's WordPiece (whose chunk separator is no token) and under a byte-level BPE
    (whose separator is a token: read between neighbours from its cache, computed before the chunk)."""
    return request.getfixturevalue(request.param)


@pytest.fixture()
def index(tiny, tmp_path) -> KVIndex:
    write_docs(tmp_path / "docs")
    return KVIndex.build(tmp_path / "docs", tmp_path / "idx", CACHED, adapter=tiny, progress=False)


@pytest.fixture()
def any_index(model, tmp_path) -> KVIndex:
    write_docs(tmp_path / "docs")
    return KVIndex.build(tmp_path / "docs", tmp_path / "idx", CACHED, adapter=model, progress=False)


@pytest.fixture()
def one_index(model, tmp_path) -> KVIndex:
    """The same documents, each chunk's cache behind its one most similar chunk: an exact context."""
    write_docs(tmp_path / "docs")
    return KVIndex.build(
        tmp_path / "docs", tmp_path / "one", CACHED.with_index(context_chunks=1), adapter=model, progress=False
    )


def recorded(index: KVIndex, ids) -> list[tuple[int, ...]]:
    table = NeighbourTable(index.path)
    return [tuple(n) for n in table[index.addressing.neighbour_key(ids)]]


def text_cache(tiny, ids, context) -> ChunkKV:
    return next(compute_caches(tiny, [ids], context, 4096))[1]


def mean(tiny, a: ChunkKV, b: ChunkKV) -> ChunkKV:
    """The mean of two caches of one chunk at `a`'s positions, as a query reading both averages them."""
    blend = BlendKV((a, b), tiny.inv_freq)
    layers = [blend.layer(i) for i in range(blend.n_layers)]
    return ChunkKV([k for k, _ in layers], [v for _, v in layers], blend.position)


def stored_mean(index: KVIndex, ids, context) -> ChunkKV:
    """What the index stores for chunk `ids` behind the neighbour `context`: its mean with the behind-prefix cache."""
    return index.store.get(index.addressing.mean_key(ids, (context, index.format.prefix_ids)))


def built_before_session_40(monkeypatch, *args, **kwargs) -> KVIndex:
    """`KVIndex.build`, as releases before session 40 made an index: no stored means recorded (so none made)."""
    create = ChunkIndex.create

    def without(path, embedder, name, meta, index_type):
        return create(path, embedder, name, {k: v for k, v in meta.items() if k != STORED_MEANS_KEY}, index_type)

    with monkeypatch.context() as patch:
        patch.setattr(ChunkIndex, "create", without)
        return KVIndex.build(*args, **kwargs)


def question_segments(index: KVIndex, question: str = "Who kept the lighthouse diary of ships?"):
    fmt = index.format
    return fmt.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], fmt.question_ids(index.adapter.tokenizer, question)
    )


def assert_same(a: LayerSource, b: LayerSource) -> None:
    assert a.position == b.position and a.n_layers == b.n_layers
    for layer in range(a.n_layers):
        torch.testing.assert_close(a.layer(layer), b.layer(layer), atol=ATOL, rtol=0)


def assert_same_caches(index: KVIndex, reference: KVIndex) -> None:
    """`index` uses the caches `reference` uses, and each holds the same K/V."""
    assert set(index.maker.live_keys()) == set(reference.maker.live_keys())
    for key in reference.maker.live_keys():
        assert_same(index.store.get(key), reference.store.get(key))


def test_caches_in_place_give_the_context_a_prefill_of_its_text_gives(model, one_index):
    """The invariant: a cached context whose caches hold what a prefill of its tokens gives (the prefix,
    then the first chunk behind it) yields the chunk's cache a prefill behind that text yields."""
    tiny, index = model, one_index
    fmt = index.format
    assert bool(fmt.separator_ids) == (tiny.name == "tiny-llama-bpe")  # BPE: the separator is tokens
    chunk = next(index.chunks.all_chunks())
    (near,) = recorded(index, chunk.token_ids)
    prefix, first = text_cache(tiny, fmt.prefix_ids, ()), text_cache(tiny, near, fmt.prefix_ids)
    past = cached_context([prefix, first], tiny.inv_freq, tiny.device, tiny.dtype)
    whole = tiny.prefill_packed([fmt.prefix_ids + near])[0]
    for layer in range(tiny.layout.n_layers):  # nothing moved: the context is the prefill's
        torch.testing.assert_close(past[0][layer], whole[0][layer], atol=ATOL, rtol=0)
        torch.testing.assert_close(past[1][layer], whole[1][layer], atol=ATOL, rtol=0)
    context = fmt.prefix_ids + near + fmt.separator_ids
    cached = compute_behind_cached(tiny, chunk.token_ids, [prefix, first], fmt.separator_ids)
    assert_same(cached, text_cache(tiny, chunk.token_ids, context))
    behind_prefix = text_cache(tiny, chunk.token_ids, fmt.prefix_ids)
    want = mean(tiny, text_cache(tiny, chunk.token_ids, context), behind_prefix)
    assert_same(stored_mean(index, chunk.token_ids, context), want)  # the index's own, read back


def test_a_cache_moved_into_the_context_is_re_rotated(tiny, index):
    """A cached sequence computed at p and laid at q reads as its keys rotated by q - p (values as they are)."""
    fmt = index.format
    a, b = (tuple(c.token_ids) for c in list(index.chunks.all_chunks())[:2])
    kv_a, kv_b = text_cache(tiny, a, fmt.prefix_ids), text_cache(tiny, b, fmt.prefix_ids)
    prefix = text_cache(tiny, fmt.prefix_ids, ())
    keys, values = cached_context([prefix, kv_a, kv_b], tiny.inv_freq, tiny.device, tiny.dtype)
    at = len(fmt.prefix_ids) + len(a)  # where b sits; computed at len(prefix)
    moved = text_cache(tiny, b, tuple(range(1000, 1000 + at)))  # b behind any `at` tokens: same positions
    for layer in range(tiny.layout.n_layers):
        assert keys[layer].shape[1] == at + len(b)
        torch.testing.assert_close(
            keys[layer][:, at:],
            rerotate(kv_b.keys[layer], at - len(fmt.prefix_ids), tiny.inv_freq),
            atol=ATOL,
            rtol=0,
        )
        assert torch.equal(values[layer][:, at:], kv_b.values[layer])
        if layer > 0:  # layer 0's keys see no context; later ones are not what b's keys behind a's would be
            assert not torch.allclose(keys[layer][:, at:], moved.keys[layer], atol=ATOL)
    with pytest.raises(ValueError, match="at least one cached sequence"):
        cached_context([], tiny.inv_freq, tiny.device, tiny.dtype)
    with pytest.raises(ValueError, match="non-empty chunk"):
        compute_behind_cached(tiny, (), [prefix])


def test_one_neighbour_is_exact_more_are_not_and_keys_are_their_own(model, any_index, one_index, tmp_path):
    """Behind one neighbour the cached context is exact, so the cache equals the recomputed-text index's;
    behind two the second neighbour's cache has not seen the first, so the chunk's K/V differ; the
    recomputed-text index addresses neither of these caches (another namespace). A chunk has one neighbour
    cache, behind all its neighbours, read (with its behind-prefix one) wherever chunks come before it."""
    tiny, index = model, any_index
    text = KVIndex.build(
        tmp_path / "docs",
        tmp_path / "idx-text",
        CACHED.with_index(chunk_prefill="neighbours"),
        adapter=tiny,
        progress=False,
    )
    chunk = next(index.chunks.all_chunks())
    near = recorded(index, chunk.token_ids)
    assert near == recorded(text, chunk.token_ids) and len(near) == 2
    one, two = text.addressing.neighbour_contexts(near)  # the recomputed-text index: a cache at each depth
    assert index.addressing.neighbour_contexts(near) == [two] and recorded(one_index, chunk.token_ids) == near[:1]
    for depth in (1, 2, 5):
        assert index.addressing.contexts_at(depth, chunk.token_ids) == (two, index.format.prefix_ids)
    prefix = index.format.prefix_ids
    behind_prefix = text.store.get(text.addressing.key(chunk.token_ids, prefix))
    assert_same(
        stored_mean(one_index, chunk.token_ids, one),
        mean(tiny, text.store.get(text.addressing.key(chunk.token_ids, one)), behind_prefix),
    )
    assert stored_mean(index, chunk.token_ids, one) is None  # no cache at depth 1
    mine, theirs = (
        stored_mean(index, chunk.token_ids, two),
        mean(tiny, text.store.get(text.addressing.key(chunk.token_ids, two)), behind_prefix),
    )
    assert mine.position == theirs.position == len(two)
    assert (mine.keys[-1] - theirs.keys[-1]).abs().max() > 1e-3
    assert index.addressing.mean_key(chunk.token_ids, (two, prefix)) not in text.store
    assert index.addressing.key(chunk.token_ids, two) not in index.store  # the mean alone, not the cache itself


def test_the_index_records_it_reopens_and_reads_its_stored_means(tiny, index):
    reopened = KVIndex.open(index.path, adapter=tiny)
    assert reopened.config.index.chunk_prefill == "cached_neighbours" and reopened.config.index.context_chunks == 2
    assert KVIndex.config_of(index.path).index.chunk_prefill == "cached_neighbours"
    assert list(reopened.maker.lacking_neighbour_caches()) == []
    fmt = reopened.format
    segments = question_segments(reopened)
    caches = reopened.caches.open(segments)
    assert caches.missing == 0 and reopened.maker.addressing.stored_means
    assert not any(isinstance(s, BlendKV) for s in caches.sources)  # one stored cache a chunk
    chunk = segments[3].ids
    near, prefix = reopened.addressing.contexts_at(1, chunk)
    assert caches.contexts[3] is None and prefix == fmt.prefix_ids
    assert_same(caches.sources[3], stored_mean(reopened, chunk, near))
    chunks = [
        p
        for p in FusionInput.build(segments, caches.sources, caches.contexts).parts
        if p.segment.label.startswith("chunk")
    ]
    assert chunks[0].exact and not any(p.exact for p in chunks[1:])
    gen = FusedGenerator(reopened)
    torch.testing.assert_close(
        gen.fuse(segments, FusionConfig(method="prefix")).result.logits,
        gen.fuse(segments, FusionConfig(method="full")).result.logits,
        atol=ATOL,
        rtol=0,
    )
    assert reopened.orphans() == []


def test_a_stored_mean_fuses_as_the_mean_an_older_index_averages_per_query(tiny, index, tmp_path, monkeypatch):
    """Storing the mean at indexing changes nothing a query computes, only what it reads: an index built before
    session 40 (the neighbour cache alone, averaged with the behind-prefix one per query) reads two caches a
    chunk after the first where the new index reads one, and fuses the prompt to the same logits."""
    old = built_before_session_40(
        monkeypatch, tmp_path / "docs", tmp_path / "old", CACHED, adapter=tiny, progress=False
    )
    segments = question_segments(index)
    assert question_segments(old) == segments
    mine, theirs = index.caches.open(segments), old.caches.open(segments)
    assert mine.missing == theirs.missing == 0 and mine.contexts == theirs.contexts
    assert isinstance(theirs.sources[3], BlendKV) and not isinstance(mine.sources[3], BlendKV)
    assert len(theirs.opened) == 2 * len(mine.opened) - 2  # the prefix's and the first chunk's are read alone
    for method in ("epic_match", "cacheblend"):
        fused = [FusedGenerator(i).fuse(segments, FusionConfig(method=method)).result.logits for i in (index, old)]
        torch.testing.assert_close(*fused, atol=ATOL, rtol=0)
    assert old.orphans() == [] and index.orphans() == []


def test_a_prompt_laid_out_as_a_chunks_neighbour_context_reads_its_mean_inexact(index):
    """The neighbour cache was computed behind cached K/V, not a prefill of the context's text: a prompt
    holding just those neighbours before the chunk reads its stored mean, none missing, and repairs it."""
    chunk = next(index.chunks.all_chunks())
    near = recorded(index, chunk.token_ids)
    question = index.format.question_ids(index.adapter.tokenizer, "Who kept the diary?")
    segments = index.format.segments([*reversed(near), chunk.token_ids], question)
    caches = index.caches.open(segments)
    parts = [
        p
        for p in FusionInput.build(segments, caches.sources, caches.contexts).parts
        if p.segment.label.startswith("chunk")
    ]
    assert caches.missing == 0 and len(parts) == 3 and parts[0].exact and not parts[-1].exact
    assert_same(caches.sources[-2], stored_mean(index, chunk.token_ids, index.addressing.neighbour_context(near)))


def test_a_missing_or_corrupt_stored_mean_is_remade_as_indexing_made_it(index, caplog):
    """Faults: a stored mean gone when a query reads it is not computed while the prompt waits: the prompt
    computes the chunk where it stands, as `full` does (its behind-prefix cache read in its place would lose facts
    the default keeps), and the mean is remade off the request path
    (`backfill`: the neighbour cache computed again, averaged with the stored behind-prefix one); one corrupted
    on disk is found by `check` and remade by its repair. Either way it comes back as indexing made it."""
    from rag_kvcache.maintenance import check

    segments = question_segments(index)
    named = address(index.addressing, segments)[3]  # the second chunk's: its mean
    (key,) = named.keys
    before = index.store.get(key)
    index.store.memory.remove(key)
    index.store.disk.remove(key)
    planned = index.caches.open(segments, make=False)  # as the vLLM connector's scheduler plans a load
    caches = index.caches.open(segments)
    assert caches.missing == 1 and caches.sources[3] is None  # computed in the prompt
    assert planned.sources[3] is None  # the scheduler plans what the worker does
    assert key in index.caches.wanted and key not in index.store
    assert index.caches.backfill() == 1 and not index.caches.wanted
    assert_same(index.store.disk.open(key), before)
    index.store.memory.remove(key)
    path = index.store.path(key)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # in the last layer's data
    path.write_bytes(bytes(raw))
    report = check(index, repair=True, progress=False)
    assert len(report.problems) == 1 and key in report.problems[0] and report.recomputed == 1
    assert check(index, progress=False).ok
    assert_same(index.store.disk.open(key), before)


def test_a_run_killed_midway_resumes_and_stores_the_same_caches(tiny, tmp_path, monkeypatch):
    """A run killed after some neighbour caches were stored is completed by the next: the neighbours were
    recorded before any of their caches was computed, so what was stored is the index's (no orphan, nothing
    for `gc`), the next run keeps it and computes the rest; the caches equal those of an uninterrupted run."""
    from rag_kvcache.maintenance import check

    write_docs(tmp_path / "docs")
    whole = KVIndex.build(tmp_path / "docs", tmp_path / "whole", CACHED, adapter=tiny, progress=False)
    index = KVIndex.create(tmp_path / "idx", CACHED, adapter=tiny)
    real, calls = index.maker.recipe.behind_neighbours, []

    def dies_on_the_fourth(ids, near, pause=None):
        calls.append(ids)
        if len(calls) == 4:
            raise KeyboardInterrupt("killed while computing neighbour caches")
        return real(ids, near, pause)

    monkeypatch.setattr(index.maker.recipe, "behind_neighbours", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        index.update(tmp_path / "docs", progress=False)
    monkeypatch.undo()
    assert len(NeighbourTable(index.path)) > 0 and index.maker.made >= 3
    reopened = KVIndex.open(index.path, adapter=tiny)
    assert reopened.orphans() == [] and check(reopened, progress=False).ok  # kept work, not garbage or damage
    n_chunks = len(list(reopened.chunks.all_chunks()))
    assert len(list(reopened.maker.lacking_neighbour_caches())) == n_chunks - 3
    done = reopened.maker.precompute_neighbours(list(reopened.maker.lacking_neighbour_caches()), progress=False)
    total = sum(
        len(whole.addressing.neighbour_contexts(recorded(whole, c.token_ids))) for c in whole.chunks.all_chunks()
    )
    assert done == total - 3  # the three stored before the kill are kept
    assert list(reopened.maker.lacking_neighbour_caches()) == []
    assert_same_caches(reopened, whole)


def test_the_neighbour_pass_leaves_the_memory_tier_to_queries(index):
    """The neighbour pass reads every chunk's behind-prefix cache several times (as a neighbour, and for the mean)
    and read them through the memory tier, where a server indexing uploaded documents evicted its queries' hot
    caches with them. Indexing writes to disk and reads without promoting: the memory tier stays empty."""
    assert index.config.runtime.storage.memory_bytes > 0 and len(index.store.memory) == 0
    assert index.update(index.path.parent / "docs", progress=False).unchanged  # nothing new: it read nothing
    (index.path.parent / "docs" / "new.txt").write_text("Ada Rennick's lamp burned whale oil until 1890.")
    index.update(index.path.parent / "docs", progress=False)
    assert len(index.store.memory) == 0 and list(index.maker.lacking_neighbour_caches()) == []


def test_a_document_deleted_and_indexed_again_gets_its_neighbour_caches_back(index, tiny, tmp_path):
    """Deleting a document collected its chunks' caches but the table kept their texts' neighbours, so indexing it
    again computed only the behind-prefix caches: the neighbour caches stayed missing (`check` said so, every
    query recomputed them). Now the next run computes what is missing, to the caches a fresh build holds."""
    whole = KVIndex.build(tmp_path / "docs", tmp_path / "whole", CACHED, adapter=tiny, progress=False)
    source = sorted(DOCS)[0]
    assert index.delete([source]) == [source]
    assert index.update(tmp_path / "docs", progress=False).added == [source]
    assert list(index.maker.lacking_neighbour_caches()) == []
    assert all(key in index.store for key in index.maker.live_keys())
    assert_same_caches(index, whole)


def test_a_deleted_documents_texts_leave_the_neighbour_table(index, tiny, tmp_path):
    """The neighbour table kept an entry for every text ever indexed: a deleted document's stayed after its caches
    were collected, so the table grew with every edit. Deleting (and `gc`) now forgets them, in memory and on disk;
    the entries of what is still indexed are kept as they were."""
    source = sorted(DOCS)[0]
    key = index.addressing.neighbour_key
    gone = {key(c.token_ids) for c in index.chunks.all_chunks() if c.source == source}
    kept = {key(c.token_ids) for c in index.chunks.all_chunks() if c.source != source}
    before = dict(NeighbourTable(index.path))
    assert gone and kept and set(before) == gone | kept and not gone & kept
    index.delete([source])
    on_disk = NeighbourTable(index.path)
    assert on_disk == {k: before[k] for k in kept} and set(index.addressing.neighbours) == kept
    reopened = KVIndex.open(index.path, CACHED, adapter=tiny)
    assert set(reopened.addressing.neighbours) == kept and reopened.collect().neighbour_records == 0


def test_a_write_that_fails_midway_loses_nothing_written_and_the_next_run_completes(tiny, tmp_path, monkeypatch):
    """The neighbour caches are written behind the compute: a write that fails (a full disk) is raised by the
    run, every other write it made is whole in the store and named by the recorded table (the index's, not
    garbage), and the next run computes only what is missing; the caches equal an uninterrupted run's."""
    write_docs(tmp_path / "docs")
    whole = KVIndex.build(tmp_path / "docs", tmp_path / "whole", CACHED, adapter=tiny, progress=False)
    neighbour_caches = {
        key for c in whole.chunks.all_chunks() for key, _ in whole.addressing.neighbour_reads(c.token_ids)
    }
    index = KVIndex.create(tmp_path / "idx", CACHED, adapter=tiny)
    real_pass, real_write, writes = index.maker.precompute_neighbours, index.store.write, []

    def disk_full_on_the_third(key, data, cost=None):
        writes.append(key)
        if len(writes) == 3:
            raise StorageFullError(errno.ENOSPC, "No space left on device")
        return real_write(key, data, cost)

    def pass_on_a_filling_disk(chunks, progress=True):
        monkeypatch.setattr(index.store, "write", disk_full_on_the_third)
        return real_pass(chunks, progress)

    monkeypatch.setattr(index.maker, "precompute_neighbours", pass_on_a_filling_disk)
    with pytest.raises(StorageFullError):
        index.update(tmp_path / "docs", progress=False)
    monkeypatch.undo()
    assert len(NeighbourTable(index.path)) > 0 and writes[2] not in index.store
    written = [key for i, key in enumerate(writes) if i != 2]
    assert all(key in index.store for key in written)
    reopened = KVIndex.open(index.path, adapter=tiny)
    assert reopened.orphans() == []
    done = reopened.maker.precompute_neighbours(list(reopened.maker.lacking_neighbour_caches()), progress=False)
    assert done == len(neighbour_caches - set(written)) and done < len(neighbour_caches)
    assert_same_caches(reopened, whole)


def test_a_missing_neighbour_cache_is_recomputed_and_the_result_unchanged(any_index, caplog):
    """Fault: a neighbour's behind-prefix cache (and the separator's, where it is a token) gone when a context
    is built from it is recomputed, stored again and logged; the chunk's cache comes out the same."""
    index = any_index
    chunk = next(index.chunks.all_chunks())
    near = recorded(index, chunk.token_ids)
    before = index.maker.recipe.behind_neighbours(chunk.token_ids, near)
    fmt = index.format
    gone = [near[1], *([fmt.separator_ids] if fmt.separator_ids else [])]
    for ids in gone:
        index.store.memory.remove(index.addressing.key(ids, fmt.prefix_ids))
        index.store.disk.remove(index.addressing.key(ids, fmt.prefix_ids))
    with caplog.at_level(logging.INFO):
        after = index.maker.recipe.behind_neighbours(chunk.token_ids, near)
    assert caplog.text.count("made and stored the KV cache") == len(gone)
    assert all(index.addressing.key(ids, fmt.prefix_ids) in index.store for ids in gone)
    assert all(index.addressing.key(ids, fmt.prefix_ids) in index.maker.live_keys() for ids in gone)  # never collected
    assert_same(after, before)


def test_an_index_with_a_cache_at_each_depth_still_reads_and_gc_collects_the_shallow_ones(tiny, tmp_path, monkeypatch):
    """An index built when cached_neighbours stored a cache behind each number of neighbours (sessions 17-38,
    none stored as a mean) reads its deepest one, none missing; its shallower ones are orphans, and `collect` (`rag-kvcache gc`)
    removes them without a chunk missing a cache."""
    write_docs(tmp_path / "docs")
    with monkeypatch.context() as patch:
        patch.setattr(CacheAddressing, "neighbour_sets", lambda self, near: [near[:j] for j in range(1, len(near) + 1)])
        old = built_before_session_40(
            monkeypatch, tmp_path / "docs", tmp_path / "old", CACHED, adapter=tiny, progress=False
        )
    reopened = KVIndex.open(old.path, adapter=tiny)
    assert not reopened.addressing.stored_means
    chunks = list(reopened.chunks.all_chunks())
    shallow = {
        reopened.addressing.key(c.token_ids, reopened.addressing.neighbour_context(recorded(reopened, c.token_ids)[:1]))
        for c in chunks
    }
    assert {path.stem for path in reopened.orphans()} == shallow and len(shallow) == len(chunks)
    segments = question_segments(reopened)
    assert reopened.caches.open(segments).missing == 0
    reopened.collect()
    assert reopened.orphans() == [] and not any(key in reopened.store.disk for key in shallow)
    assert KVIndex.open(old.path, adapter=tiny).caches.open(segments).missing == 0


def test_an_old_recomputed_text_index_still_reads_its_own_caches(tiny, tmp_path):
    """An index built with chunk_prefill="neighbours" opens as that and reads its caches, none missing."""
    write_docs(tmp_path / "docs")
    old = KVIndex.build(
        tmp_path / "docs", tmp_path / "old", CACHED.with_index(chunk_prefill="neighbours"), adapter=tiny, progress=False
    )
    reopened = KVIndex.open(old.path, adapter=tiny)
    assert reopened.config.index.chunk_prefill == "neighbours"
    segments = question_segments(reopened)
    assert reopened.caches.open(segments).missing == 0


def test_config_names_the_bad_value():
    with pytest.raises(ValueError, match="cached_neighbours.*got 'cached'"):
        Config(index=IndexSettings(chunk_prefill="cached"))


GROUPED = IndexSettings(chunk_prefill="grouped")


def test_bench_and_cli_name_it():
    """`method@cached_neighbours` runs a method on an index built with it; the CLI offers it."""
    from typer.testing import CliRunner

    from rag_kvcache.bench.variants import made_with, parse_variant
    from rag_kvcache.cli import app

    variant = parse_variant("epic_match@cached_neighbours", FusionConfig(), Config(index=GROUPED))
    assert (
        variant.caches == "cached_neighbours" and variant.label == "epic_match@cached_neighbours k=64"
    )  # 512-token chunks
    assert made_with(Config(index=GROUPED), "cached_neighbours").index.chunk_prefill == "cached_neighbours"
    assert parse_variant("epic_match@cached_neighbours", FusionConfig(), Config()).caches is None  # the default
    assert parse_variant("reuse@cached_neighbours", FusionConfig(), replace(CACHED)).caches is None  # the run's own
    result = CliRunner().invoke(app, ["index", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "cached_neighbours" in result.output


def test_a_reader_reads_the_neighbours_an_index_run_records_after_it_opened(index, tiny):
    """A server opened before an `index` run's neighbour pass reads each chunk behind the prefix alone; once the
    run records the neighbours (another process writes the neighbour table), the reader's next prompt reads the
    neighbour caches, without a restart."""
    table = dict(NeighbourTable(index.path))
    drop(index.path)  # the state before the neighbour pass
    reader = KVIndex.open(index.path, adapter=tiny)
    segments = question_segments(reader)
    assert reader.caches.open(segments).contexts[3] == reader.addressing.chunk_context
    NeighbourTable(index.path).record(table.items())  # the pass recorded them
    caches = reader.caches.open(segments)
    assert caches.contexts[3] is None and caches.missing == 0  # the stored mean of two contexts, read as one


def test_neighbours_recorded_a_batch_at_a_time_are_the_ones_one_search_finds(index, tiny, monkeypatch):
    """`record_neighbours` searches and records a batch of chunks at a time, so that what it holds meanwhile stays
    bounded on a large corpus; the table it writes is the one a search over all the chunks at once gives."""
    whole = dict(NeighbourTable(index.path))
    index.close()
    drop(index.path)
    reopened = KVIndex.open(index.path, adapter=tiny)
    chunks = list(reopened.chunks.all_chunks())
    searched, nearest = [], reopened.chunks.nearest
    monkeypatch.setattr("rag_kvcache.indexing.maker.BATCH", 2)
    monkeypatch.setattr(reopened.chunks, "nearest", lambda batch, k: searched.append(len(batch)) or nearest(batch, k))
    reopened.maker.record_neighbours(chunks)
    assert sum(searched) == len(chunks) > 2 and max(searched) == 2
    assert len(whole) == len({c.token_ids for c in chunks})
    assert dict(NeighbourTable(index.path)) == whole
