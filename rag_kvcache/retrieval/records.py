"""What the chunk index hands out: an indexed chunk (`ChunkRecord`), a search result (`Hit`), and a document
given as text (`TextDocument`).

All three are frozen values. A `ChunkRecord`'s id is derived from its content (`database.chunk_id` of its source,
ordinal and token ids), so the same chunk has the same id in every index and every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .chunking import Chunk
from .database import chunk_id


@dataclass(frozen=True)
class ChunkRecord(Chunk):
    """An indexed chunk: a `Chunk` with its content-derived id."""

    id: str

    @classmethod
    def from_chunk(cls, chunk: Chunk) -> ChunkRecord:
        """The record of `chunk`, with its id derived from its source, ordinal and token ids."""
        return cls(
            chunk.source,
            chunk.ordinal,
            chunk.token_ids,
            chunk.char_start,
            chunk.char_end,
            chunk.text,
            id=chunk_id(chunk.source, chunk.ordinal, chunk.token_ids),
        )


@dataclass(frozen=True)
class Hit:
    """A search result: the chunk and its cosine similarity to the query (that of its best window)."""

    chunk: ChunkRecord
    score: float  # in [-1, 1], higher is closer


@dataclass(frozen=True)
class TextDocument:
    """A document given as text rather than as a file (a vector store's), with its JSON-able metadata;
    its `source` is its id in the index."""

    source: str
    text: str = field(repr=False)
    metadata: Mapping[str, object] = field(default_factory=dict)
