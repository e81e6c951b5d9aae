"""`ServingEngine`: an opened index and its generator, confined to one worker thread.

A chat's turns share work through the engine: its generator keeps fused prompts' K/V
(`ConversationCache`, `StorageConfig.conversation_bytes`), read by the turns that continue them.

An index owns a SQLite connection (bound to the thread that opened it) and one model that serves
one request at a time, so everything that touches it runs on the engine's own worker thread; async
callers, which run the sync methods from executor threads, work unchanged. An engine is an explicit
object: open one per index and hand it to every model and retriever that should share it, and
`close()` it (or use it as a context manager) to release the index and end the thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..config import Config, FusionConfig, GenerationConfig
from ..engine.model import ModelAdapter
from ..engine.prompt import Segment
from ..index import KVIndex
from ..query.answers import Answer
from ..query.generator import FusedGenerator
from ..retrieval.records import Hit
from ..store.conversations import ConversationCache

T = TypeVar("T")


class ServingEngine:
    """An opened `KVIndex` and its `FusedGenerator`, confined to one worker thread."""

    def __init__(self, path: str | Path, config: Config | None = None, adapter: ModelAdapter | None = None) -> None:
        """Open the index at `path` (with `config`, default: the settings it was built with; `adapter`
        injects a loaded model)."""
        self.path = Path(path).expanduser().resolve()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rag-kvcache:{self.path.name}")
        self._closed = False
        try:
            self.index = self.run(KVIndex.open, self.path, config, adapter)
        except BaseException:
            self._worker.shutdown()
            raise
        budget = self.index.config.runtime.storage.conversation_bytes
        self.generator = FusedGenerator(self.index, ConversationCache(budget) if budget else None)

    def __enter__(self) -> ServingEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the worker thread."""
        return self._worker.submit(fn, *args).result()

    def search(self, query: str, k: int) -> list[Hit]:
        return self.run(self.index.search, query, k)

    def stream(
        self,
        segments: Sequence[Segment],
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
        timeout: float | None = None,
    ) -> Iterator[str | Answer]:
        """`FusedGenerator.stream`, each step computed on the worker thread. Past `timeout` seconds
        (checked after each step: the fused prefill is one step, not interrupted) it raises `TimeoutError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        steps = self.generator.stream(segments, fusion, generation)
        while (step := self.run(next, steps, None)) is not None:
            if deadline is not None and time.monotonic() > deadline:
                self.run(steps.close)
                raise TimeoutError(f"generation over index {self.path} took longer than timeout={timeout} s")
            yield step

    def close(self) -> None:
        """Close the index on its thread and end the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self.run(self.index.close)
            self._worker.shutdown()


class EngineHandle:
    """The engine an integration object (chat model, LLM, retriever) serves from: the `engine` it
    was given, shared with others, or else one it opens itself for `index` on first use and closes
    with `close()`. Exactly one of the two must be given; `index` must be an index folder. `device`
    and `dtype` (None: the index's settings) are how an engine opened for `index` loads the model."""

    def __init__(
        self,
        engine: ServingEngine | None,
        index: str | Path | None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        if (engine is None) == (index is None):
            raise ValueError(
                "give either engine= (an opened ServingEngine, to share) or index= (an index folder), not "
                f"{'both' if engine is not None else 'neither'}"
            )
        if engine is not None and (device, dtype) != (None, None):
            raise ValueError(
                f"device={device!r} and dtype={dtype!r} apply to an engine opened for index=; the given "
                f"engine= of {engine.path} is already loaded on {engine.index.config.runtime.device}"
            )
        self._given = engine
        self._own: ServingEngine | None = None
        self.index_path = engine.path if engine is not None else Path(index).expanduser().resolve()
        config = (
            engine.index.config if engine is not None else KVIndex.config_of(self.index_path)
        )  # refuses a non-index
        self._config = config.placed(device, dtype)  # a dtype it does not know is refused here (ConfigError)
        self.model_name = config.index.model

    def get(self) -> ServingEngine:
        if self._given is not None:
            return self._given
        if self._own is None:
            self._own = ServingEngine(self.index_path, self._config)
        return self._own

    def close(self) -> None:
        """Close the engine this handle opened (a given engine belongs to whoever opened it)."""
        if self._own is not None:
            self._own.close()
            self._own = None
