"""What both integrations' test suites share: the bundled demo documents, the demo question, and empty
indexes that borrow an engine's loaded model (the fixtures are in `integrations/conftest.py`)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from rag_kvcache import Config, IndexSettings, KVIndex, ServingEngine

DEMO_DOCS = files("rag_kvcache") / "demo"
QUESTION = "What is the main telescope of the Veldmark Observatory called?"


def empty_engine(path: Path, demo_engine: ServingEngine) -> ServingEngine:
    """An empty index at `path` sharing the demo engine's loaded model, opened."""
    config = Config(index=IndexSettings(chunk_tokens=128))
    adapter = demo_engine.index.adapter
    demo_engine.run(lambda: KVIndex.create(path, config, adapter).close())
    return ServingEngine(path, config, adapter)
