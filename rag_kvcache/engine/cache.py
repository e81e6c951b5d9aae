"""A chunk's cache as the fusion engine reads it: per-layer keys and values, one layer at a time.

`LayerSource` is what the engine asks of a cache (the store's tiers implement it); `ChunkKV` is a cache held
whole in memory; `SliceKV` is a run of a cache's tokens (part of a chunk found in a prompt); `BlendKV` is the
mean of one chunk's caches computed behind different contexts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from .ops import rotate_keys, rotation

LayerKV = list[tuple[torch.Tensor, torch.Tensor] | None]  # per segment: keys, values [H_kv, T, D], or None


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's cache: per-layer keys/values [H_kv, T, D], computed at positions position..position+T-1;
    `stacked`, when they are views of one [L, 2, H_kv, T, D] tensor (`ChunkKV.viewing`), that tensor."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: int
    stacked: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def viewing(cls, whole: torch.Tensor, position: int) -> ChunkKV:
        """The cache held as one tensor `whole` [L, 2, H_kv, T, D], its layers views of it: read whole by
        `all_layers` without a copy, as the memory tier's entries are."""
        return cls(list(whole[:, 0].unbind(0)), list(whole[:, 1].unbind(0)), position, whole)

    @classmethod
    def cut(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], start: int, end: int) -> ChunkKV:
        """A copy of the span start..end-1 of a prompt's per-layer K/V [H_kv, N, D]: the cache of the tokens there,
        computed at their positions in the prompt."""
        span = [torch.stack((k[:, start:end], v[:, start:end])) for k, v in zip(keys, values)]  # L x [2, H_kv, T, D]
        return cls.viewing(torch.stack(span), start)  # [L, 2, H_kv, T, D]

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @cached_property
    def nbytes(self) -> int:  # read by the memory tier on every hit
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def to(self, device: torch.device | str) -> ChunkKV:
        """This cache on `device` (itself when already there)."""
        if all(t.device == torch.device(device) for t in (*self.keys, *self.values)):
            return self
        return ChunkKV([k.to(device) for k in self.keys], [v.to(device) for v in self.values], self.position)

    def pinned(self) -> ChunkKV:
        """This cache in page-locked host memory (needs CUDA), which a GPU reads by DMA while the host goes on
        (`read_layer`). PyTorch's host allocator rounds each tensor's block up to a power of two."""
        return ChunkKV([k.pin_memory() for k in self.keys], [v.pin_memory() for v in self.values], self.position)


class LayerSource(Protocol):
    """A chunk cache whose layers can be read one at a time: a `ChunkKV` in memory, or a stored `Entry`."""

    @property
    def position(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def read_layer(sources: Sequence[LayerSource | None], layer: int, device: torch.device | str) -> LayerKV:
    """One layer of every source (None for a segment without a cache), on `device`.

    For a CUDA device, layers in pinned host memory (`ChunkKV.pinned`: the memory tier's, beside a GPU) are
    each copied asynchronously, by DMA; layers in pageable host memory go over in one transfer: gathered into
    one pinned buffer and copied asynchronously, then viewed per segment. Copied one tensor at a time from
    pageable memory, each copy (two per segment per layer) would wait for the stream's queued compute and
    block the host until done, so the fusion's launches could never run ahead of the device."""
    layers = [None if s is None else s.layer(layer) for s in sources]  # per segment: [H_kv, T, D] x 2, or None
    device = torch.device(device)
    away = [t for kv in layers if kv is not None for t in kv if t.device != device]
    if not away:  # every cache already there (a device-resident tier): nothing dispatched
        return layers
    host = [t for t in away if t.device.type == "cpu"] if device.type == "cuda" else []
    if len(host) < len(away) or len({t.dtype for t in host}) > 1:
        return [None if kv is None else (kv[0].to(device), kv[1].to(device)) for kv in layers]
    if all(t.is_pinned() for t in host):  # no staging copy on the host: the DMA reads them in place
        return [
            None if kv is None else (kv[0].to(device, non_blocking=True), kv[1].to(device, non_blocking=True))
            for kv in layers
        ]
    staging = torch.empty(sum(t.numel() for t in host), dtype=host[0].dtype, pin_memory=True)  # [S], flat
    views, start = {}, 0
    for t in host:
        views[id(t)] = start
        staging[start : start + t.numel()].view(t.shape).copy_(t)  # [H_kv, T, D]
        start += t.numel()
    packed = staging.to(device, non_blocking=True)  # [S]: ordered before the fusion's kernels by the stream

    def placed(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(device)
        return packed[views[id(t)] : views[id(t)] + t.numel()].view(t.shape)  # [H_kv, T, D]

    return [None if kv is None else (placed(kv[0]), placed(kv[1])) for kv in layers]


def held(source: LayerSource) -> tuple[ChunkKV, slice] | None:
    """The in-memory cache `source` reads and the run of its tokens (a `ChunkKV` itself, all of it; a slice of
    one, its run), or None: a stored entry, read from its tier."""
    if isinstance(source, ChunkKV):
        return source, slice(None)
    if isinstance(source, SliceKV) and isinstance(source.source, ChunkKV):
        return source.source, slice(source.start, source.stop)
    return None


def resident(source: LayerSource | None) -> bool:
    """Whether reading `source` is copying memory (`held`): nothing to read ahead."""
    return source is None or held(source) is not None


def all_layers(source: LayerSource) -> torch.Tensor:
    """Every layer of `source` as one tensor [L, 2, H_kv, T, D]: a view of a stacked `ChunkKV` (a slice's
    tokens of one), else its layers stacked (one copy)."""
    memory = held(source)
    if memory is not None and memory[0].stacked is not None:
        return memory[0].stacked[..., memory[1], :]  # [L, 2, H_kv, T, D]
    return torch.stack([torch.stack(source.layer(i)) for i in range(source.n_layers)])  # [L, 2, H_kv, T, D]


def pack_layers(
    sources: Sequence[LayerSource | None], layers: range, device: torch.device | str
) -> torch.Tensor | None:
    """Layers `layers` of every cached segment, packed end to end in segment order on `device`: keys and
    values [L', 2, H_kv, C, D] (a view) for the C cached tokens of the prompt (None: no segment has a
    cache). Each layer is read (`read_layer`: in place from a device-resident tier, one pinned transfer a
    layer from host memory), then one concatenation for all of them, whatever the number of segments;
    `KVPlacement.place` puts the pack in the prompt."""
    if all(s is None for s in sources):
        return None
    reads = [[kv for kv in read_layer(sources, i, device) if kv is not None] for i in layers]  # [H_kv, T, D] x 2
    pieces = [kv[j] for per_layer in reads for j in (0, 1) for kv in per_layer]  # (layer, K or V, segment)
    flat = torch.cat(pieces, dim=1)  # [H_kv, L' * 2 * C, D]
    h_kv, _, d = flat.shape
    return flat.view(h_kv, len(layers), 2, -1, d).permute(1, 2, 0, 3, 4)  # [L', 2, H_kv, C, D]


def pack_layer(sources: Sequence[LayerSource | None], layer: int, device: torch.device | str) -> torch.Tensor | None:
    """`pack_layers` for one layer: [2, H_kv, C, D] (None: no segment has a cache)."""
    packed = pack_layers(sources, range(layer, layer + 1), device)  # [1, 2, H_kv, C, D]
    return None if packed is None else packed[0]


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


def blend_layers(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], turns: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of one layer of several caches of the same tokens, cache j's keys first moved by the
    `rotation` turns[j] (None: already in place) to the first cache's positions (RoPE composes); summed
    in float32 and returned in the first cache's dtype."""
    k0, v0 = layers[0]
    keys = k0.to(torch.float32, copy=True)  # [H_kv, T, D]
    values = v0.to(torch.float32, copy=True)  # [H_kv, T, D]
    for (k, v), turn in zip(layers[1:], turns[1:]):
        k = k.to(keys.device)  # [H_kv, T, D]; a cache recomputed on the model's device may join stored ones
        keys += k if turn is None else rotate_keys(k.float(), *(t.to(k.device) for t in turn))  # [H_kv, T, D]
        values += v.to(values.device)  # [H_kv, T, D]
    return keys.mul_(1 / len(layers)).to(k0.dtype), values.mul_(1 / len(layers)).to(v0.dtype)  # [H_kv, T, D]


@dataclass(frozen=True)
class BlendKV:
    """One chunk's caches computed behind different contexts (so at different positions), read as their
    mean at the first one's position (`blend_layers`). A chunk whose cache contexts the prompt does not
    reproduce deviates from what a full prefill computes in ways particular to each context; averaging
    the caches behind the prefix and behind its neighbours cancels part of that (issue 13)."""

    sources: tuple[LayerSource, ...]
    inv_freq: torch.Tensor  # [D/2], the model's RoPE frequencies

    def __post_init__(self) -> None:
        shapes = {(s.n_tokens, s.n_layers) for s in self.sources}
        if len(self.sources) < 2 or len(shapes) != 1:
            raise ValueError(
                f"a blend needs two or more caches of one chunk, got (tokens, layers) {shapes} "
                f"from {len(self.sources)} cache(s)"
            )

    @property
    def position(self) -> int:
        return self.sources[0].position

    @property
    def n_tokens(self) -> int:
        return self.sources[0].n_tokens

    @property
    def n_layers(self) -> int:
        return self.sources[0].n_layers

    @cached_property
    def turns(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per source, the rotation (cos, sin [1, D]) moving its keys to the first's positions: made once,
        read for every layer."""
        return [
            None if s.position == self.position else rotation(self.position - s.position, self.inv_freq)
            for s in self.sources
        ]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return blend_layers([s.layer(i) for s in self.sources], self.turns)
