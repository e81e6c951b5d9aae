"""`Config` by lifetime (issue 34): an index records its `IndexSettings` as one JSON value and is read with
them; query defaults and the runtime are never recorded; an index that recorded each setting as its own
string (made before) opens with the same settings and reads its caches."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import torch
from test_codec_default import QUESTION, write_docs

from rag_kvcache.config import Config, ConfigError, GenerationConfig, IndexSettings, QueryConfig, RuntimeConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.provenance import SETTINGS_KEY
from rag_kvcache.query.generator import FusedGenerator

BUILT = IndexSettings(chunk_tokens=24, chunk_prefill="isolated", context_chunks=2, codec="none", index_type="hnsw")


def test_settings_round_trip_through_json_and_refuse_an_unknown_key():
    assert IndexSettings.from_json(BUILT.to_json()) == BUILT
    with pytest.raises(ConfigError, match="'chunk_overlap'"):
        IndexSettings.from_json(BUILT.to_json()[:-1] + ', "chunk_overlap": 8}')


def test_an_index_records_its_settings_and_nothing_of_the_process_that_built_it(tiny, tmp_path):
    cfg = Config(
        index=BUILT,
        query=QueryConfig(top_k=2, generation=GenerationConfig(max_new_tokens=3)),
        runtime=RuntimeConfig(max_file_bytes=4096, cache_dir=tmp_path / "cache"),
    )
    KVIndex.build(write_docs(tmp_path / "docs"), tmp_path / "idx", cfg, adapter=tiny, progress=False).close()
    base = Config()
    read = KVIndex.config_of(tmp_path / "idx", base)
    assert read.index == BUILT and isinstance(read.index.chunk_tokens, int)  # typed, not strings
    assert read.query == base.query and read.runtime == base.runtime  # the reader's own


def test_an_index_that_recorded_each_setting_as_a_string_opens_as_it_was_built(tiny, tmp_path):
    cfg = Config(index=BUILT, query=QueryConfig(top_k=2, generation=GenerationConfig(max_new_tokens=4)))
    built = KVIndex.build(write_docs(tmp_path / "docs"), tmp_path / "idx", cfg, adapter=tiny, progress=False)
    before = FusedGenerator(built).ask(QUESTION)
    built.close()
    with sqlite3.connect(tmp_path / "idx" / "index.sqlite") as conn:  # the metadata as earlier releases wrote it
        conn.execute("DELETE FROM meta WHERE key = ?", (SETTINGS_KEY,))
        flat = {name: str(getattr(BUILT, name)) for name in ("model", "chunk_tokens", "chunk_prefill", "dtype")}
        flat |= {"system_prompt": BUILT.system_prompt, "context_chunks": "2", "kv_codec": BUILT.codec}
        conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", flat.items())
    assert KVIndex.config_of(tmp_path / "idx").index == BUILT  # embedder and index_type: the index's own keys
    reopened = KVIndex.open(tmp_path / "idx", KVIndex.config_of(tmp_path / "idx", cfg), adapter=tiny)
    after = FusedGenerator(reopened).ask(QUESTION)
    assert after.cache_misses == 0 and after.answer == before.answer
    assert torch.equal(after.first_token_logits, before.first_token_logits)


def test_the_index_embeds_in_the_runtimes_embedder_dtype_and_records_nothing_of_it(tiny, tmp_path):
    cfg = Config(index=BUILT, runtime=RuntimeConfig(embedder_dtype="bfloat16", cache_dir=tmp_path / "cache"))
    built = KVIndex.build(write_docs(tmp_path / "docs"), tmp_path / "idx", cfg, adapter=tiny, progress=False)
    assert {p.dtype for p in built.chunks._embedder.parameters()} == {torch.bfloat16}
    vectors = built.embed([QUESTION, "another text"])  # [2, E]: unit vectors in float32, as `check` requires
    assert vectors.dtype == np.float32 and np.abs(np.linalg.norm(vectors, axis=1) - 1.0).max() < 1e-6
    built.close()
    assert KVIndex.config_of(tmp_path / "idx").runtime.embedder_dtype == "auto"  # the reader's own
    reader = Config(index=BUILT, runtime=RuntimeConfig(embedder_dtype="float32"))
    reopened = KVIndex.open(tmp_path / "idx", reader, adapter=tiny)
    assert {p.dtype for p in reopened.chunks._embedder.parameters()} == {torch.float32}
    assert reopened.search(QUESTION, 1)  # float32 queries find the chunks bfloat16 embedded
    reopened.close()
