"""Storage by default (issue 33): caches are stored with int8 keys and 4-bit values, `index` says how much
disk they take before computing them (both caches a chunk of the default neighbour index), and an index built
under another codec is read as it records."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch
from rich.filesize import decimal

from rag_kvcache.config import Config, GenerationConfig, IndexSettings, QueryConfig, RuntimeConfig, StorageConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.backend import header_nbytes
from rag_kvcache.store.codecs import cache_nbytes

CFG = Config(
    index=IndexSettings(chunk_tokens=24),
    query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=6)),
    runtime=RuntimeConfig(storage=StorageConfig(memory_bytes=0)),
)
QUESTION = "What is the telescope of the Veldmark Observatory named?"


def write_docs(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "a.txt").write_text("The main telescope of the Veldmark Observatory is named Harrow's Eye. " * 6)
    (root / "b.txt").write_text("Saltmere is a mill village on the river Anvel, known for its caraway bread. " * 6)
    return root


def test_a_default_index_stores_int8_keys_and_4_bit_values_and_says_the_size_first(tiny, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rag_kvcache"):
        index = KVIndex.build(write_docs(tmp_path / "docs"), tmp_path / "idx", CFG, adapter=tiny, progress=False)
    assert index.store.codec.name == "int8k-int4v"
    assert KVIndex.config_of(tmp_path / "idx").index.codec == "int8k-int4v"  # recorded
    chunks = set(index.chunks.token_ids())  # repeated text makes equal chunks, which share one cache
    said = decimal(index.kv_bytes(map(len, chunks)))
    assert f"computing the KV caches of {len(chunks)} chunks" in caplog.text and f"about {said} on disk" in caplog.text
    per_chunk = index.maker.caches_per_chunk  # the default's two: behind the prefix and behind the neighbours
    assert per_chunk == 2 and "2 caches a chunk" in caplog.text
    files = list((tmp_path / "idx" / "kv").rglob("*.safetensors"))  # the chunks', the prefix's (and separator's)
    sep = index.format.separator_ids
    prefix = cache_nbytes(index.store.codec, tiny.layout, [len(index.format.prefix_ids)], 0)
    separator = cache_nbytes(index.store.codec, tiny.layout, [len(sep)] if sep else [], len(index.format.prefix_ids))
    position = len(index.format.prefix_ids)
    payload = per_chunk * cache_nbytes(index.store.codec, tiny.layout, map(len, chunks), position)
    assert len(files) == per_chunk * len(chunks) + 1 + bool(sep)
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in files)  # safetensors: length, then JSON
    assert sum(p.stat().st_size for p in files) - headers == payload + prefix + separator  # the payload, exactly
    not_chunks = {index.store.path(index.addressing.key(index.format.prefix_ids, ()))}
    not_chunks |= {index.store.path(index.addressing.key(sep, index.format.prefix_ids))} if sep else set()
    chunk_files = sum(p.stat().st_size for p in files if p not in not_chunks)
    said_bytes = index.kv_bytes(map(len, chunks))  # headers estimated as a whole chunk's: a little over
    assert chunk_files <= said_bytes <= chunk_files + 64 * len(files)
    # of 4 bytes of float32: keys a byte an element and a float32 scale per channel per chunk of 24 tokens, values
    # half a byte and a float32 scale and low end per channel (one group: chunks under 64 tokens); two caches,
    # neither at a sequence's start
    keys, values = 1 + 4 / CFG.index.chunk_tokens, 0.5 + 8 / CFG.index.chunk_tokens
    layout = tiny.layout
    raw = layout.n_layers * layout.n_kv_heads * layout.head_dim * layout.dtype.itemsize  # K (or V) of a token
    header = header_nbytes(index.store.codec, layout, CFG.index.chunk_tokens, position) / CFG.index.chunk_tokens
    assert index.kv_bytes_per_token == pytest.approx(per_chunk * (raw * (keys + values) / 4 + header))


def test_an_index_built_before_the_default_changed_reads_as_it_records(tiny, tmp_path):
    old = KVIndex.build(
        write_docs(tmp_path / "docs"), tmp_path / "idx", CFG.with_index(codec="none"), adapter=tiny, progress=False
    )
    before = FusedGenerator(old).ask(QUESTION)
    reopened = KVIndex.open(tmp_path / "idx", CFG, adapter=tiny)  # today's default config: int8k-int4v
    assert reopened.store.codec.name == "none" and reopened.config.index.codec == "none"
    after = FusedGenerator(reopened).ask(QUESTION)
    assert after.cache_misses == 0 and after.answer == before.answer
    assert torch.equal(after.first_token_logits, before.first_token_logits)
