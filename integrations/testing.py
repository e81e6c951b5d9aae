"""What both integrations' test suites share: the bundled demo documents, the demo question, a schema for
structured answers to it, and empty indexes that borrow an engine's loaded model (the fixtures are in
`integrations/conftest.py`)."""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from pydantic import BaseModel, Field

from rag_kvcache import Config, IndexSettings, KVIndex, ServingEngine

DEMO_DOCS = files("rag_kvcache") / "demo"
QUESTION = "What is the main telescope of the Veldmark Observatory called?"


class Telescope(BaseModel):
    """The telescope the question asks about."""

    name: str = Field(description="the telescope's name")
    observatory: str = Field(description="the observatory it belongs to")


def demo_files() -> list[Traversable]:
    """The bundled demo documents (the package ships them as `demo/*.md`), by file name."""
    return sorted((f for f in DEMO_DOCS.iterdir() if f.name.endswith(".md")), key=lambda f: f.name)


def empty_engine(path: Path, demo_engine: ServingEngine) -> ServingEngine:
    """An empty index at `path` sharing the demo engine's loaded model, opened."""
    config = Config(index=IndexSettings(chunk_tokens=128))
    adapter = demo_engine.index.adapter
    demo_engine.run(lambda: KVIndex.create(path, config, adapter).close())
    return ServingEngine(path, config, adapter)
