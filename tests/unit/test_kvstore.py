"""The content-addressed KV store: round trip, misses, atomicity and integrity."""

from __future__ import annotations

import logging

import torch

from rag_kvcache.config import StorageConfig
from rag_kvcache.store.addressing import cache_key
from rag_kvcache.store.kvstore import ChunkKV, KVStore

LOSSLESS = "none"  # the codec: these tests read back exactly what they stored


def make_kv(layers: int = 3, tokens: int = 5, position: int = 7, dtype=torch.float32) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    return ChunkKV(
        [torch.randn(2, tokens, 8, generator=g).to(dtype) for _ in range(layers)],
        [torch.randn(2, tokens, 8, generator=g).to(dtype) for _ in range(layers)],
        position,
    )


def test_round_trip(tmp_path):
    store, kv = KVStore(tmp_path, LOSSLESS), make_kv(dtype=torch.bfloat16)
    key = cache_key("ns", (1, 2), (3, 4, 5))
    assert store.get(key) is None and key not in store
    store.put(key, kv)
    got = store.get(key)
    assert got.position == 7 and got.n_tokens == 5
    for a, b in zip(got.keys + got.values, kv.keys + kv.values):
        assert torch.equal(a, b) and a.dtype == torch.bfloat16
    assert not list(tmp_path.rglob(".tmp-*"))  # nothing half-written left behind


def test_memory_tier_on_the_device_holds_what_is_read_there(tmp_path):
    # with memory_on_device, an entry read whole from disk is promoted onto the model's device ("meta" stands
    # in for a GPU here; tests/gpu/test_gpu.py reads one on CUDA); without it, the tier stays in host memory
    key = cache_key("ns", (), (3, 4, 5))
    for on_device, where in ((True, "meta"), (False, "cpu")):
        store = KVStore(tmp_path / str(on_device), LOSSLESS, StorageConfig(memory_on_device=on_device), device="meta")
        store.put(key, make_kv())
        assert store.get(key).keys[0].device.type == "cpu"  # read from disk, then promoted
        held = store.open(key)
        assert isinstance(held, ChunkKV) and {t.device.type for t in (*held.keys, *held.values)} == {where}
        assert store.memory.nbytes == make_kv().nbytes


def test_key_depends_on_namespace_context_and_ids():
    base = cache_key("ns", (1,), (2, 3))
    assert (
        len({base, cache_key("other", (1,), (2, 3)), cache_key("ns", (), (1, 2, 3)), cache_key("ns", (1,), (2, 4))})
        == 4
    )
    assert cache_key("ns", (1,), (2, 3)) == base


def test_bit_flip_is_detected_and_dropped(tmp_path, caplog):
    store = KVStore(tmp_path, LOSSLESS)
    store.put("ab" * 16, make_kv())
    path = store.path("ab" * 16)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # corrupt the last tensor's data
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert store.get("ab" * 16) is None
    assert "checksum mismatch" in caplog.text and not path.exists()


def test_truncated_file_is_a_miss(tmp_path, caplog):
    store = KVStore(tmp_path, LOSSLESS)
    store.put("cd" * 16, make_kv())
    path = store.path("cd" * 16)
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert store.get("cd" * 16) is None
    assert "corrupt" in caplog.text


def test_load_reads_an_entry_into_the_memory_tier_once(tmp_path):
    key = cache_key("ns", (), (3, 4, 5))
    store = KVStore(tmp_path, LOSSLESS)
    store.put(key, make_kv())
    assert key not in store.memory  # indexing does not fill the memory tier
    assert store.load(key) and key in store.memory
    assert not store.load(key)  # there already: nothing read
    held = store.open(key)
    assert isinstance(held, ChunkKV) and all(torch.equal(a, b) for a, b in zip(held.keys, make_kv().keys))
    assert not store.load("ef" * 16)  # missing: left to its reader, which makes it
    off = KVStore(tmp_path / "off", LOSSLESS, StorageConfig(memory_bytes=0))
    off.put(key, make_kv())
    assert not off.load(key) and len(off.memory) == 0


def test_a_corrupt_entry_is_not_loaded_and_is_dropped(tmp_path, caplog):
    # fault injection: a bit flipped on disk; loading it ahead reads nothing into memory and drops the entry, so
    # the prompt that needs it recomputes it (as when it reads it itself)
    store = KVStore(tmp_path, LOSSLESS)
    store.put("ab" * 16, make_kv())
    path = store.path("ab" * 16)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert not store.load("ab" * 16)
    assert "ab" * 16 not in store.memory and not path.exists() and "checksum mismatch" in caplog.text
