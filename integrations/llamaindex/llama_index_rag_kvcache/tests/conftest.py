"""A demo index (datasets/demo, 128-token chunks, SmolLM2-135M) built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_kvcache import Config, KVIndex

DEMO_DOCS = Path(__file__).resolve().parents[4] / "datasets" / "demo"


@pytest.fixture(scope="session")
def demo_index(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama-index-rag-kvcache") / "demo-index"
    KVIndex.build(DEMO_DOCS, path, Config(chunk_tokens=128), progress=False)
    return str(path)
