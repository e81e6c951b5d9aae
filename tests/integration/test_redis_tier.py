"""The shared KV tier on a real Redis server (`redis-server`, started on a free loopback port by each
test and stopped by it): layer-wise reads, entries shared by two indexes, written once, corruption
detected and repaired, eviction by the server making misses (never wrong hits), and the server
killed mid-query leaving the answer as it is without the remote tier."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from redis_server import RedisServer, needs_redis_server
from test_cli import model_dir  # noqa: F401 (a fixture: a saved tiny model for the CLI)
from test_faults import CFG, QUESTION, write_docs
from test_kvstore import make_kv
from test_serve import start_server, stop_server
from typer.testing import CliRunner

from rag_kvcache.cli import app
from rag_kvcache.config import StorageConfig
from rag_kvcache.engine.cache import ChunkKV
from rag_kvcache.index import KVIndex
from rag_kvcache.query.answers import Answer
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.serving.engine import ServingEngine
from rag_kvcache.serving.openai_api import create_app
from rag_kvcache.serving.settings import ServerConfig
from rag_kvcache.store.backend import CorruptEntryError, UnreachableEntryError, encode_entry
from rag_kvcache.store.kvstore import KVStore
from rag_kvcache.store.redis_tier import RedisTier

pytestmark = needs_redis_server

SECRET = b"cluster-secret-0123456789"


@pytest.fixture()
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


def remote_cfg(url: str, writable: bool = True) -> StorageConfig:
    """The tests' storage over the remote tier at `url`, written by default (as by a trusted writer:
    `remote_writable`; unset, a tier without a secret is read-only)."""
    return replace(CFG.runtime.storage, remote=url, remote_writable=writable)


def copy_without_caches(index_dir: Path, to: Path) -> Path:
    """An index's chunks and vectors without its disk caches: another machine that opened the same index."""
    shutil.copytree(index_dir, to, ignore=lambda d, names: ["kv"] if Path(d) == index_dir else [])
    return to


def ask(index: KVIndex) -> Answer:
    return FusedGenerator(index).ask(QUESTION, index.search(QUESTION, 3))


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory) -> tuple[Path, Answer]:
    """An index with its caches on disk, no remote tier, and its answer to QUESTION: the reference."""
    root = tmp_path_factory.mktemp("corpus")
    a = KVIndex.build(write_docs(root / "docs", 3), root / "a", CFG, adapter=tiny, progress=False)
    return root / "a", ask(a)


@pytest.fixture()
def shared(tiny, corpus, server, tmp_path) -> KVIndex:
    """The corpus's index on another machine: no disk caches; every cache in the remote tier."""
    return on_another_machine(tiny, corpus[0], remote_cfg(server.url), tmp_path / "b")


@pytest.fixture()
def shared_with_secret(tiny, corpus, server, tmp_path) -> KVIndex:
    """`shared`, its cluster sharing a secret: every remote entry authenticated."""
    return on_another_machine(tiny, corpus[0], replace(remote_cfg(server.url), remote_secret=SECRET), tmp_path / "b")


def on_another_machine(tiny, index_dir: Path, storage: StorageConfig, to: Path) -> KVIndex:
    """The index at `index_dir` opened over `storage` with no disk caches, every cache in its remote tier."""
    tier = RedisTier(replace(storage, remote_writable=True), CFG.index.codec)  # the machine that indexed, trusted
    for path in (index_dir / "kv").rglob("*.safetensors"):
        tier.write(path.stem, path.read_bytes())
    return KVIndex.open(copy_without_caches(index_dir, to), CFG.with_runtime(storage=storage), adapter=tiny)


def remote_value(index: KVIndex, server: RedisServer) -> tuple[str, bytes]:
    """The remote key and stored value of the top chunk's cache."""
    key = index.store.remote.redis_key(index.addressing.own_key(index.search(QUESTION, 1)[0].chunk.token_ids))
    return key, server.client().get(key)


@pytest.mark.parametrize("codec", ["none", "int8-channel"])
def test_a_remote_entry_is_read_one_layer_at_a_time(server, codec):
    tier = RedisTier(StorageConfig(remote=server.url, remote_writable=True), codec)
    kv = make_kv(layers=4, tokens=6)
    assert tier.open("k1") is None and "k1" not in tier
    assert tier.put("k1", kv) > 0 and "k1" in tier
    entry = tier.open("k1")
    k, v = entry.layer(2)
    torch.testing.assert_close(k, kv.keys[2], atol=0.05 if codec != "none" else 0, rtol=0)
    torch.testing.assert_close(v, kv.values[2], atol=0.05 if codec != "none" else 0, rtol=0)
    layer_bytes = {"none": kv.keys[2].nbytes + kv.values[2].nbytes, "int8-channel": 2 * (2 * 6 * 8 + 2 * 8 * 4)}[codec]
    assert tier.stats.bytes_read == layer_bytes  # one layer's bytes crossed the network, not the entry's
    other = RedisTier(
        StorageConfig(remote=server.url, remote_writable=True), "int8-token" if codec == "none" else "none"
    )
    assert other.open("k1") is None  # stored with another codec: a miss, never read as this codec
    tier.remove("k1")
    assert tier.open("k1") is None and (tier.stats.hits, tier.stats.misses, tier.stats.errors) == (1, 2, 0)


def test_an_entry_is_written_once_by_the_first_writer(server, tmp_path):
    first, second = (
        KVStore(tmp_path / name, "none", StorageConfig(memory_bytes=0, remote=server.url, remote_writable=True))
        for name in "ab"
    )
    mine, theirs = make_kv(), make_kv(position=3)
    first.put("k1", mine)
    second.put("k1", theirs)  # computed too, later: the remote keeps the first
    assert second.remote.stats.bytes_written == 0 and first.remote.stats.bytes_written > 0
    assert second.remote.open("k1").position == mine.position
    assert second.get("k1").position == theirs.position  # its own disk tier comes first


def test_two_indexes_share_entries_through_the_remote_tier(tiny, tmp_path, server, corpus):
    cfg = CFG.with_runtime(storage=remote_cfg(server.url))
    a = KVIndex.build(write_docs(tmp_path / "docs", 3), tmp_path / "a", cfg, adapter=tiny, progress=False)
    assert a.store.stats()["remote"].bytes_written > 0  # indexing wrote every cache to the remote tier too
    b = KVIndex.open(copy_without_caches(tmp_path / "a", tmp_path / "b"), cfg, adapter=tiny)
    got = ask(b)
    assert got.cache_misses == 0 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-5, rtol=0)
    stats = b.store.stats()
    assert stats["remote"].hits == 4 and stats["disk"].hits == 0  # the prefix and 3 chunks, all remote hits
    assert stats["remote"].bytes_read > 0 and stats["remote"].errors == 0
    assert not list((tmp_path / "b" / "kv").rglob("*.safetensors"))


@pytest.mark.parametrize("where", ["last_layer", "header"])
def test_a_corrupt_remote_value_is_detected_and_repaired(shared, corpus, server, where, caplog):
    key, value = remote_value(shared, server)
    at = len(value) - 10 if where == "last_layer" else 40
    server.client().setrange(key, at, bytes([value[at] ^ 0xFF]))
    with caplog.at_level(logging.INFO):
        got = ask(shared)
    assert "dropping corrupt KV cache entry" in caplog.text and "made and stored the KV cache" in caplog.text
    assert got.cache_misses == 1 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-4, rtol=0)
    assert shared.store.stats()["remote"].corrupt == 1
    assert server.client().get(key) not in (None, value[:at] + bytes([value[at] ^ 0xFF]) + value[at + 1 :])
    entry = shared.store.remote.open(key.rsplit(":", 1)[1])
    assert all(entry.layer(i) for i in range(entry.n_layers))  # rewritten, intact in every layer


def test_eviction_by_the_server_makes_misses_never_wrong_hits(tmp_path):
    server = RedisServer(tmp_path / "redis", maxmemory="3mb")
    try:
        tier = RedisTier(StorageConfig(remote=server.url, remote_writable=True), "none")
        kvs = {f"k{i}": make_kv(layers=4, tokens=512, position=i) for i in range(24)}  # 256 KiB each
        for key, kv in kvs.items():
            tier.put(key, kv)
        info = tier.server_info()
        assert info["evicted_keys"] > 0 and info["maxmemory"] == 3 << 20
        kept = 0
        for key, kv in kvs.items():
            entry = tier.open(key)
            if entry is not None:
                kept += 1
                for i in range(4):
                    assert all(torch.equal(x, y) for x, y in zip(entry.layer(i), kv.layer(i)))
        assert 0 < kept < len(kvs)
        # Evicted (or replaced by another value) after it was opened, before a layer is read: corrupt, not served.
        tier.put("late", kvs["k0"])
        entry, other = tier.open("late"), tier.open("late")
        server.client().delete(tier.redis_key("late"))
        with pytest.raises(CorruptEntryError, match="read 0 of"):
            entry.layer(0)
        k0 = kvs["k0"]
        tier.put("late", ChunkKV([-k for k in k0.keys], [-v for v in k0.values], k0.position))  # same layout
        with pytest.raises(CorruptEntryError, match="checksum mismatch"):
            other.layer(1)
    finally:
        server.stop()


@pytest.mark.parametrize("when", ["mid_query", "before_query"])
def test_the_server_killed_leaves_the_answer_as_without_the_remote_tier(shared, corpus, server, when, caplog):
    open_caches = shared.caches.open

    def kill_after_opening(segments, salt="", **how):  # every entry's header was read from the server; no layer yet
        caches = open_caches(segments, salt, **how)
        server.kill()
        return caches

    if when == "mid_query":
        shared.caches.open = kill_after_opening
    else:
        server.kill()
    with caplog.at_level(logging.WARNING):
        got = ask(shared)
    if when == "mid_query":  # every cache found, then recomputed as it was stored: the same answer
        assert got.answer == corpus[1].answer
        torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-4, rtol=0)
    else:  # the neighbour caches found nowhere: computed in the prompt as `full` does, made off the request path
        assert shared.caches.wanted and got.answer
        shared.caches.backfill(limit=len(shared.caches.wanted))  # as a server does between requests
    assert caplog.text.count("does not answer") == 1  # logged once, however many requests failed
    stats = shared.store.stats()["remote"]
    assert stats.errors >= 1 and stats.corrupt == 0
    # Nothing corrupted: the recomputed caches went to the local disk, intact; the next query reads them.
    for key in (shared.addressing.own_key(h.chunk.token_ids) for h in shared.search(QUESTION, 3)):
        entry = shared.store.disk.open(key)
        assert all(entry.layer(i) for i in range(entry.n_layers))
    shared.caches.open = open_caches
    assert ask(shared).cache_misses == 0


def test_an_entry_lost_mid_read_is_not_dropped(server):
    tier = RedisTier(StorageConfig(remote=server.url, remote_retry=60, remote_writable=True), "none")
    tier.put("k1", make_kv())
    entry = tier.open("k1")
    server.kill()
    with pytest.raises(UnreachableEntryError):
        entry.layer(0)
    assert tier.open("k1") is None and "k1" not in tier  # skipped while down: no request, no wait
    assert (tier.stats.errors, tier.stats.corrupt) == (1, 0)


def test_stats_reports_the_remote_tier(shared, server):
    ask(shared)
    result = CliRunner().invoke(app, ["stats", "--index", str(shared.path), "--kv-remote", server.url])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.strip("│ ").startswith("remote"))
    assert row.split("│")[2].strip() == "4"  # hits
    assert f"remote tier redis://127.0.0.1:{server.port}/0: {server.client().dbsize()} keys" in result.output


def test_a_failed_server_shows_in_the_metrics(tiny, shared, server):
    """`GET /metrics` of a real `rag-kvcache serve` app: the remote tier's hits and bytes read while its
    server answers, then the failed requests once the server is killed."""
    no_memory = shared.config.with_storage(memory_bytes=0)  # every read remote
    with ServingEngine(shared.path, no_memory, tiny) as engine:
        http, thread, url = start_server(create_app(engine))
        try:

            def metric(name: str) -> float:
                found = re.search(
                    rf'^rag_kvcache_kv_cache_{name}_total{{tier="remote"}} (\S+)$',
                    httpx.get(f"{url}/metrics").text,
                    re.MULTILINE,
                )
                assert found is not None, f"no remote {name} in /metrics"
                return float(found.group(1))

            engine.run(ask, engine.index)
            assert (metric("hits"), metric("errors")) == (4, 0) and metric("read_bytes") > 0
            server.kill()
            assert engine.run(ask, engine.index).answer
            assert metric("errors") >= 1 and metric("hits") == 4 and metric("corrupt") == 0
        finally:
            stop_server(http, thread)


@pytest.mark.parametrize("setting", [None, True, False])
def test_the_server_prefetches_by_default_when_it_reads_a_remote_tier(tiny, corpus, shared, setting):
    """`serve --prefetch` unset is on over a remote tier (the caches wait on the network; benchmarks/RESULTS.md,
    session 34) and off over the local disk alone; given, it is as given."""
    for index_dir, cfg, remote in ((shared.path, shared.config, True), (corpus[0], CFG, False)):
        with ServingEngine(index_dir, cfg, tiny) as engine:
            server = create_app(engine, ServerConfig(prefetch=setting)).state.server
            try:
                assert (server.scheduler.loader is not None) == (remote if setting is None else setting)
            finally:
                asyncio.run(server.close())


def test_a_remote_that_is_not_a_redis_url_is_refused():
    with pytest.raises(ValueError, match="'http://cache:6379'"):
        StorageConfig(remote="http://cache:6379")


def test_an_entry_planted_in_the_shared_tier_before_indexing_is_not_taken_as_computed(tiny, tmp_path, server, corpus):
    """A validly encoded entry holding another chunk's K/V, planted under a chunk's key before `index` ran,
    was taken as present: the indexer never computed that chunk, and its own machine then answered from
    the planted entry (prefix differed from full by 4.93 in first-token logits). The indexer counts only
    its own disk: it computes every chunk there, and its answers read its disk first."""
    docs = write_docs(tmp_path / "docs", 3)
    cfg = CFG.with_runtime(storage=remote_cfg(server.url))
    probe = KVIndex.create(tmp_path / "probe", CFG, adapter=tiny)  # the keys the chunks will have
    probe.update(docs, progress=False)
    keys = [probe.addressing.own_key(ids) for ids in probe.chunks.token_ids()]
    entries = [(probe.store.disk.path(k)).read_bytes() for k in keys]
    tier = RedisTier(remote_cfg(server.url), CFG.index.codec)
    tier.client.flushdb()
    for key, forged in zip(keys, entries[1:] + entries[:1]):  # each chunk's key holds another chunk's entry
        tier.write(key, forged)
    index = KVIndex.build(docs, tmp_path / "idx", cfg, adapter=tiny, progress=False)
    assert all(key in index.store.disk for key in keys)  # computed here, not taken from the shared tier
    got = ask(index)
    assert got.cache_misses == 0 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("forgery", ["another_chunk_entry", "moved_authenticated_value"])
def test_with_a_shared_secret_a_forged_entry_is_dropped_and_recomputed(tiny, tmp_path, server, corpus, forgery, caplog):
    """With `remote_secret` every remote entry carries an HMAC over its key and bytes. A writer without
    the secret planting another chunk's validly encoded entry under a key, or moving an authenticated
    value to another key, is caught: the entry is dropped, recomputed and rewritten, the answer is the
    reference's."""
    cfg = CFG.with_runtime(storage=replace(remote_cfg(server.url), remote_secret=SECRET))
    a = KVIndex.build(write_docs(tmp_path / "docs", 3), tmp_path / "a", cfg, adapter=tiny, progress=False)
    b = KVIndex.open(copy_without_caches(tmp_path / "a", tmp_path / "b"), cfg, adapter=tiny)
    top, other = (b.addressing.own_key(h.chunk.token_ids) for h in b.search(QUESTION, 2))
    name, other_name = b.store.remote.redis_key(top), b.store.remote.redis_key(other)
    client = server.client()
    if forgery == "another_chunk_entry":  # the project's own encoder, no secret: a valid entry of the wrong chunk
        client.delete(name)
        RedisTier(remote_cfg(server.url), CFG.index.codec).write(top, a.store.disk.path(other).read_bytes())
    else:
        client.set(name, client.get(other_name))
    with caplog.at_level(logging.WARNING):
        got = ask(b)
    assert "does not verify with this cluster's secret" in caplog.text
    assert got.cache_misses == 1 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-5, rtol=0)
    assert b.store.stats()["remote"].corrupt == 1
    entry = RedisTier(cfg.runtime.storage, cfg.index.codec).open(top)  # rewritten by the honest reader, and verifies
    assert entry is not None and all(entry.layer(i) for i in range(entry.n_layers))


def test_a_secret_shorter_than_16_bytes_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes, got 6"):
        StorageConfig(remote="redis://cache:6379", remote_secret=b"secret")


def test_an_index_built_with_the_shared_tier_warns_when_opened_without_it(tiny, tmp_path, server, caplog):
    """A process that opened an index built with --kv-remote without it recomputed every cache missing from its
    disk without a word. The index records the tier (no password) and opening it without one says so."""
    url = server.url.replace("redis://", "redis://user:hunter2@", 1)
    cfg = CFG.with_runtime(storage=remote_cfg(server.url))
    KVIndex.build(write_docs(tmp_path / "docs", 2), tmp_path / "a", cfg, adapter=tiny, progress=False)
    with caplog.at_level(logging.WARNING):
        KVIndex.open(copy_without_caches(tmp_path / "a", tmp_path / "b"), CFG, adapter=tiny)
    assert "built with its KV caches also in the shared tier " + StorageConfig(remote=url).remote_address in caplog.text
    assert (
        "hunter2" not in caplog.text
        and StorageConfig(remote=url).remote_address == remote_cfg(server.url).remote_address
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        KVIndex.open(tmp_path / "b", cfg, adapter=tiny)
    assert "shared tier" not in caplog.text


def test_which_neighbour_caches_are_missing_is_one_request_to_the_shared_tier(shared_with_secret, server, monkeypatch):
    """An index whose caches are all in the shared tier (another machine's, authenticated with the cluster's
    secret) asked which chunks lack a neighbour cache: one request reading every key's entry (verified), not
    one a key (about 13,000 round trips for the 4,472 chunks of the 88-question planted corpus); a key the
    server lost is found missing by it."""
    shared = shared_with_secret
    remote = shared.store.remote
    requests = []
    ask_server = remote._request
    monkeypatch.setattr(remote, "_request", lambda call, default: requests.append(call) or ask_server(call, default))
    assert shared.maker.with_neighbours and list(shared.maker.lacking_neighbour_caches()) == []
    assert len(requests) == 1
    chunk = next(shared.chunks.all_chunks())
    (lost, _), *_ = shared.maker.addressing.neighbour_reads(chunk.token_ids)
    server.client().delete(remote.redis_key(lost))
    assert chunk in list(shared.maker.lacking_neighbour_caches())
    assert len(requests) == 2


def test_indexing_asks_the_shared_tier_once_which_neighbour_caches_to_compute(shared_with_secret, server, monkeypatch):
    """The neighbour pass over chunks whose caches are all in the shared tier (authenticated) computes none of
    them and asks the server once for every chunk's caches, not once a cache; a cache the server lost is
    computed again."""
    shared = shared_with_secret
    remote = shared.store.remote
    requests = []
    ask_server = remote._request
    monkeypatch.setattr(remote, "_request", lambda call, default: requests.append(call) or ask_server(call, default))
    chunks = list(shared.chunks.all_chunks())
    assert shared.maker.precompute_neighbours(chunks, progress=False) == 0
    assert len(requests) == 1
    (lost, _), *_ = shared.maker.addressing.neighbour_reads(chunks[0].token_ids)
    server.client().delete(remote.redis_key(lost))
    assert shared.maker.precompute_neighbours(chunks, progress=False) == 1
    assert lost in shared.store


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no_secret", "secret"])
def test_entries_planted_under_every_cache_key_before_indexing_are_computed_over(
    tiny, tmp_path, server, corpus, secret, caplog
):
    """Validly encoded entries of other caches planted in the shared tier, before `index` ran, under the keys of
    every cache the index will have (the prefix's, each chunk's own and its neighbour caches'), made the indexer
    skip the neighbour caches (their keys EXISTed there), and the index then answered from the forgeries. Now
    no cache is skipped for an entry that was not verified: every one is computed onto the index's disk, the
    answer is the reference's; without a secret the tier is left as it was (read-only), with one the forgeries
    fail their HMAC at indexing and are dropped."""
    docs = write_docs(tmp_path / "docs", 3)
    probe = KVIndex.build(docs, tmp_path / "probe", CFG, adapter=tiny, progress=False)  # the keys there will be
    keys = sorted(probe.maker.live_keys())
    assert len(keys) > 2 * len(probe.chunks)  # the neighbour caches are among them
    planter = RedisTier(remote_cfg(server.url), CFG.index.codec)  # another writer, without the secret
    for key, forged in zip(keys, keys[1:] + keys[:1]):
        planter.write(key, probe.store.disk.path(forged).read_bytes())
    planted = {k: server.client().get(planter.redis_key(k)) for k in keys}
    storage = replace(remote_cfg(server.url, writable=False), remote_secret=secret)
    with caplog.at_level(logging.WARNING):
        index = KVIndex.build(docs, tmp_path / "idx", CFG.with_runtime(storage=storage), adapter=tiny, progress=False)
    assert sorted(index.maker.live_keys()) == keys and all(key in index.store.disk for key in keys)
    got = ask(index)
    assert got.cache_misses == 0 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-5, rtol=0)
    remote = index.store.stats()["remote"]
    if secret is None:  # read-only: nothing written, nothing deleted, no entry read (none could be trusted)
        assert remote.bytes_written == 0 and remote.corrupt == 0 and remote.hits == 0
        assert {k: server.client().get(planter.redis_key(k)) for k in keys} == planted
    else:  # each forgery read once and dropped; the honest caches written in their place
        assert remote.corrupt == len(keys) and "does not verify with this cluster's secret" in caplog.text
        assert all(RedisTier(storage, CFG.index.codec).open(k) is not None for k in keys)


@pytest.mark.parametrize("writable", [True, False], ids=["writable", "read_only"])
@pytest.mark.parametrize("misfit", ["tokens", "heads"])
def test_a_remote_entry_not_the_shape_its_key_names_is_dropped_and_recomputed(
    tiny, corpus, server, tmp_path, misfit, writable, caplog
):
    """A remote entry, intact by its checksums, that is not the shape of the cache its key names (another
    cache's token count, or K/V of other heads) failed every query that read it ("cache of segment 'chunk1'
    has 126 tokens, segment has 119", or a shape error in the fusion). It is corrupt like any other: dropped,
    recomputed, reported, and the answer is the reference's."""
    shared = on_another_machine(tiny, corpus[0], remote_cfg(server.url, writable), tmp_path / "b")
    key = shared.addressing.own_key(shared.search(QUESTION, 1)[0].chunk.token_ids)
    name = shared.store.remote.redis_key(key)
    entry = shared.store.remote.open(key)
    if misfit == "tokens":  # the prefix's cache: another token count and position
        forged = (
            corpus[0]
            / "kv"
            / shared.store.path(shared.addressing.key(shared.format.prefix_ids, ())).relative_to(shared.store.root)
        ).read_bytes()
    else:  # a cache of the right tokens, position and layers, with one KV head more
        layers = [entry.layer(i) for i in range(entry.n_layers)]
        kv = ChunkKV(
            [torch.cat([k, k[:1]]) for k, _ in layers], [torch.cat([v, v[:1]]) for _, v in layers], entry.position
        )
        forged = bytes(encode_entry(kv, shared.store.codec))
    server.client().set(name, forged)
    with caplog.at_level(logging.INFO):
        got = ask(shared)
    assert "not the cache its key names" in caplog.text and "made and stored the KV cache" in caplog.text
    assert got.cache_misses == 1 and got.answer == corpus[1].answer
    torch.testing.assert_close(got.first_token_logits, corpus[1].first_token_logits, atol=1e-5, rtol=0)
    assert shared.store.stats()["remote"].corrupt == 1 and key in shared.store.disk
    left = server.client().get(name)
    assert left == forged if not writable else left != forged  # read-only: left there, and read past
    again = ask(shared)  # from the recomputed cache on this machine's disk, read before the shared tier
    assert again.cache_misses == 0 and again.answer == corpus[1].answer


def test_without_a_secret_the_shared_tier_is_read_only_unless_writable(tmp_path, server):
    """No secret and no `remote_writable`: the store writes and deletes nothing in the shared tier, and says so
    (`trust`, which `index` and `serve` print at start); `remote_writable` or a secret make it written."""
    kv = make_kv()
    stores = {
        name: KVStore(tmp_path / name, "none", StorageConfig(memory_bytes=0, remote=server.url, **settings))
        for name, settings in {
            "read_only": {},
            "writable": {"remote_writable": True},
            "secret": {"remote_secret": SECRET},
        }.items()
    }
    stores["read_only"].put("k1", kv)
    assert server.client().dbsize() == 0 and "k1" in stores["read_only"].disk
    assert "read-only (--kv-remote-writable to write it)" in stores["read_only"].trust()
    stores["writable"].put("k1", kv)
    assert server.client().dbsize() == 1 and "written too" in stores["writable"].trust()
    stores["read_only"].discard("k1")
    assert server.client().dbsize() == 1  # not deleted by the read-only store
    stores["secret"].put("k2", kv)
    assert server.client().dbsize() == 2 and "verify with the cluster's secret" in stores["secret"].trust()
    assert stores["secret"].missing(["k1", "k2", "k3"]) == {"k1", "k3"}  # k1: not authenticated; k3: nowhere
    assert stores["writable"].missing(["k1", "k2"]) == {"k2"}  # on its disk: k1; the shared tier vouches for none
    assert "shared tier" not in KVStore(tmp_path / "local", "none").trust()


def test_index_says_what_it_trusts_and_writes_the_shared_tier_only_when_told(tmp_path, server, model_dir):  # noqa: F811
    """`index --kv-remote` without a secret prints that the tier is read-only and writes nothing there;
    `--kv-remote-writable` writes it, and says so."""
    docs = write_docs(tmp_path / "docs", 2)
    args = ["index", str(docs), "--chunk-tokens", "128", "--model", str(model_dir), "--kv-remote", server.url]
    read_only = CliRunner().invoke(app, [*args, "--index", str(tmp_path / "a")])
    assert read_only.exit_code == 0, read_only.output
    assert "read-only (--kv-remote-writable to write it)" in read_only.output and server.client().dbsize() == 0
    writable = CliRunner().invoke(app, [*args, "--index", str(tmp_path / "b"), "--kv-remote-writable"])
    assert writable.exit_code == 0, writable.output
    assert "written too (--kv-remote-writable" in writable.output and server.client().dbsize() > 0
