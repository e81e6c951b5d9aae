"""One opened index per folder, shared by every model and retriever of the process (the
LangChain and LlamaIndex integrations serve through it).

An index owns a SQLite connection (bound to the thread that opened it) and one model that serves
one request at a time, so everything that touches it runs on the index's own worker thread;
async callers, which run the sync methods from executor threads, work unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..config import FusionConfig, GenerationConfig
from ..engine.prompt import Segment
from ..generator import Answer, FusedGenerator
from ..index import KVIndex

T = TypeVar("T")


class Engine:
    """An opened `KVIndex` and its `FusedGenerator`, confined to one worker thread."""

    def __init__(self, path: Path) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rag-kvcache:{path.name}")
        self.index = self.run(KVIndex.open, path)
        self.generator = FusedGenerator(self.index)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the worker thread."""
        return self._worker.submit(fn, *args).result()

    def stream(
        self, segments: Sequence[Segment], fusion: FusionConfig, generation: GenerationConfig
    ) -> Iterator[str | Answer]:
        """`FusedGenerator.stream`, each step computed on the worker thread."""
        steps = self.generator.stream(segments, fusion, generation)
        while (step := self.run(next, steps, None)) is not None:
            yield step


_ENGINES: dict[Path, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for(path: str | Path) -> Engine:
    """The process's engine for the index at `path`, opened on first use."""
    key = Path(path).expanduser().resolve()
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = Engine(key)
        return _ENGINES[key]
