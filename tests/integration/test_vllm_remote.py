"""`RagKVCacheConnector` reading the shared KV tier (`kv_remote`): how vLLM replicas on several machines share
one set of chunk caches. No vLLM engine: the connector's `Planner` (what its scheduler and worker sides lay a
prompt out with) over a real redis-server. Runs in `.venv-vllm`; skipped where vLLM is not installed."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from redis_server import RedisServer, needs_redis_server  # noqa: E402

import rag_kvcache  # noqa: E402
from rag_kvcache.config import Config, FusionConfig, IndexSettings  # noqa: E402
from rag_kvcache.engine.model import ModelAdapter  # noqa: E402
from rag_kvcache.engine.spec import ModelSpec  # noqa: E402
from rag_kvcache.index import KVIndex  # noqa: E402
from rag_kvcache.serving.vllm_planning import Planner  # noqa: E402

pytestmark = [pytest.mark.smollm2, needs_redis_server]


def test_a_replica_without_the_disk_caches_reads_them_from_the_shared_tier(tmp_path: Path, caplog) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        config = (
            Config(index=IndexSettings(chunk_tokens=128))
            .with_index(codec="none")
            .with_storage(remote=server.url, remote_writable=True)
        )
        index = KVIndex.build(Path(rag_kvcache.__file__).parent / "demo", tmp_path / "a", config, progress=False)
        records = list(index.chunks.all_chunks())[:3]
        fmt = index.format
        prompt = [
            t
            for s in fmt.segments([r.token_ids for r in records], fmt.question_ids(index.adapter.tokenizer, "Why?"))
            for t in s.ids
        ]
        index.close()
        # another machine: the index's chunks and vectors, none of its disk caches
        shutil.copytree(
            tmp_path / "a", tmp_path / "b", ignore=lambda d, names: ["kv"] if Path(d) == tmp_path / "a" else []
        )

        planner = Planner(tmp_path / "b", ModelSpec.load(config), server.url)  # the scheduler's: no weights
        _, inp = planner.layout(prompt, FusionConfig(method="reuse"))
        stats = planner.index.store.stats()
        assert stats["remote"].hits == 4 and stats["disk"].hits == 0  # the system prefix and 3 chunks, all shared
        assert all(p.kv is not None for p in inp.parts if p.segment.cacheable)
        planner.index.close()

        with caplog.at_level(logging.INFO):  # without `kv_remote`: said, and every cache recomputed
            alone = Planner(tmp_path / "b", ModelAdapter.load(config))  # one that computes
            assert "opened without it" in caplog.text
            _, made = alone.layout(prompt, FusionConfig(method="reuse"))
        assert "remote" not in alone.index.store.stats()
        # the prefix's cache and the first chunk's behind it, each recomputed once, said, and stored; the later
        # chunks' neighbour caches are not made while a prompt waits: their segments are left to the prefill
        stored = list((tmp_path / "b" / "kv").rglob("*.safetensors"))
        assert caplog.text.count("made and stored the KV cache") == len(stored) == 2
        assert [p.kv is None for p in made.parts if p.segment.label.startswith("chunk")] == [False, True, True]
        alone.index.close()
    finally:
        server.stop()
