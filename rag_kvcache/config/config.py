"""`Config`, the one configuration object, passed explicitly everywhere (no globals, no environment): an
`IndexSettings`, a `QueryConfig` and a `RuntimeConfig`, and the `with_*` methods that give a copy with some of
their settings changed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .index import IndexSettings
from .query import QueryConfig
from .runtime import RuntimeConfig


@dataclass(frozen=True)
class Config:
    """Everything that decides what is indexed, cached and generated, by lifetime: what an index records
    (`index`), how questions are answered by default (`query`), where this process runs (`runtime`)."""

    index: IndexSettings = field(default_factory=IndexSettings)
    query: QueryConfig = field(default_factory=QueryConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def with_index(self, **changes: object) -> Config:
        return replace(self, index=replace(self.index, **changes))

    def with_query(self, **changes: object) -> Config:
        return replace(self, query=replace(self.query, **changes))

    def with_runtime(self, **changes: object) -> Config:
        return replace(self, runtime=replace(self.runtime, **changes))

    def with_fusion(self, **changes: object) -> Config:
        return self.with_query(fusion=replace(self.query.fusion, **changes))

    def with_generation(self, **changes: object) -> Config:
        return self.with_query(generation=replace(self.query.generation, **changes))

    def with_storage(self, **changes: object) -> Config:
        return self.with_runtime(storage=replace(self.runtime.storage, **changes))

    def placed(self, device: str | None, dtype: str | None) -> Config:
        """This config with the model on `device` in `dtype`, each kept as it is when None (an index is read
        in the dtype it records unless told otherwise)."""
        config = self if device is None else self.with_runtime(device=device)
        return config if dtype is None else config.with_index(dtype=dtype)
