"""A chunk's cache as the fusion engine reads it: per-layer keys and values, one layer at a time.

`LayerSource` is what the engine asks of a cache (the store's tiers implement it); `ChunkKV` is a cache held
whole in memory; `SliceKV` is a run of a cache's tokens (part of a chunk found in a prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor] | None]  # per segment: keys, values [H_kv, T, D], or None


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's cache: per-layer keys/values [H_kv, T, D], computed at positions position..position+T-1."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: int

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]


class LayerSource(Protocol):
    """A chunk cache whose layers can be read one at a time: a `ChunkKV` in memory, or a stored `Entry`."""

    position: int

    @property
    def n_tokens(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def read_layer(sources: Sequence[LayerSource | None], layer: int, device: torch.device | str) -> LayerKV:
    """One layer of every source (None for a segment without a cache), on `device`."""
    out: LayerKV = []
    for source in sources:
        if source is None:
            out.append(None)
            continue
        k, v = source.layer(layer)  # [H_kv, T, D]
        out.append((k.to(device), v.to(device)))
    return out


@dataclass(frozen=True)
class SliceKV:
    """Tokens [start, stop) of a cache: the part of a chunk that a prompt holds (a matched span)."""

    source: LayerSource
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.source.n_tokens:
            raise ValueError(f"slice [{self.start}:{self.stop}] of a {self.source.n_tokens}-token cache")

    @property
    def position(self) -> int:
        return self.source.position + self.start

    @property
    def n_tokens(self) -> int:
        return self.stop - self.start

    @property
    def n_layers(self) -> int:
        return self.source.n_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.source.layer(i)  # [H_kv, T, D]
        return k[:, self.start : self.stop], v[:, self.start : self.stop]  # [H_kv, stop - start, D]
