"""The selective-prefill engine: one forward, layer by layer, that computes only an *active* set of
tokens; every other token's K/V comes from its chunk cache, re-rotated to its place in the prompt.

`FusionInput` lays the prompt out (token ids, segments, their caches, which caches are exact);
`selective_prefill` runs the forward over it. Cached layers arrive through a `LayerReader` (the
store's pipelined feed, a plain read in the caller's thread, or every layer at once for caches held in
memory: `WholeReader`) already assembled: one [2, H_kv, N, D]
buffer per layer (from the query path's `KVBufferPool`, kept across prompts) holding every cached
token at its prompt position, keys re-rotated. Where they go is laid out once per prompt
(`KVPlacement`); per layer the caches are packed in two concatenations (in the reader's thread), then
the moved keys are rotated in one pass and the pack is placed, however many segments the prompt has.
Recomputed tokens attend with the exact causal mask over their original positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from .buffers import KVBufferPool
from .cache import LayerSource, all_layers, pack_layer, pack_layers
from .graphs import settled_layers
from .interface import FusionModel, Pick, StepInput
from .ops import attention_plan, causal_attend, rope_cos_sin, rotate_keys, rotation
from .profiling import StageClock
from .prompt import Segment


@dataclass(frozen=True)
class SegmentKV:
    """A prompt segment, where it starts, and its cache (None: computed at query time)."""

    segment: Segment
    start: int
    kv: LayerSource | None
    exact: bool  # cache equals what a full prefill computes here (same position, same tokens before)

    @property
    def end(self) -> int:
        return self.start + len(self.segment.ids)

    @property
    def fresh(self) -> bool:
        """No cache: computed at query time."""
        return self.kv is None

    @property
    def reusable(self) -> bool:
        """A cache that is not exact here: a candidate for recomputation."""
        return self.kv is not None and not self.exact


@dataclass(frozen=True)
class FusionInput:
    """The prompt's tokens and its segments' caches, laid out in prompt order: `parts[i]` starts where
    `parts[i - 1]` ends, and the last part (the question) has no cache."""

    ids: torch.Tensor  # [N]
    parts: tuple[SegmentKV, ...]

    @classmethod
    def build(
        cls,
        segments: Sequence[Segment],
        caches: Sequence[LayerSource | None],
        contexts: Sequence[tuple[int, ...] | None],
        device: torch.device | str = "cpu",
    ) -> FusionInput:
        """Lay segments out in order; `contexts[i]` are the tokens segment i's cache was computed behind (None:
        a mean of caches behind several, exact behind none)."""
        if not (len(segments) == len(caches) == len(contexts)):
            raise ValueError(f"{len(segments)} segments, {len(caches)} caches, {len(contexts)} contexts")
        ids: list[int] = []
        parts = []
        for seg, kv, ctx in zip(segments, caches, contexts):
            if kv is not None and kv.n_tokens != len(seg.ids):
                raise ValueError(f"cache of segment {seg.label!r} has {kv.n_tokens} tokens, segment has {len(seg.ids)}")
            exact = kv is not None and ctx is not None and kv.position == len(ids) and tuple(ids) == tuple(ctx)
            parts.append(SegmentKV(seg, len(ids), kv, exact))
            ids.extend(seg.ids)
        if not parts or parts[-1].kv is not None:
            raise ValueError("the prompt must end with an uncached segment (the question)")
        tokens = torch.from_numpy(np.array(ids, dtype=np.int64))  # [N]: a third of torch.tensor's time on a list
        return cls(tokens.to(device), tuple(parts))

    @property
    def n_tokens(self) -> int:
        return self.ids.numel()

    @property
    def sources(self) -> list[LayerSource | None]:
        return [p.kv for p in self.parts]

    @property
    def segment_of(self) -> torch.Tensor:
        """The number of the segment each token belongs to [N]."""
        lengths = torch.tensor([len(p.segment.ids) for p in self.parts], device=self.ids.device)  # [P]
        return torch.repeat_interleave(torch.arange(len(self.parts), device=self.ids.device), lengths)  # [N]

    def count(self, pred: Callable[[SegmentKV], bool]) -> int:
        """Tokens of the segments `pred` picks: `token_mask(pred).sum()`, counted on the host (no device sync)."""
        return sum(len(p.segment.ids) for p in self.parts if pred(p))

    def token_mask(self, pred: Callable[[SegmentKV], bool]) -> torch.Tensor:
        mask = torch.zeros(self.n_tokens, dtype=torch.bool, device=self.ids.device)  # [N]
        for p in self.parts:
            if pred(p):
                mask[p.start : p.end] = True
        return mask

    @cached_property
    def fresh(self) -> torch.Tensor:
        """Tokens with no cache [N]: always recomputed."""
        return self.token_mask(lambda p: p.fresh)

    @cached_property
    def reusable(self) -> torch.Tensor:
        """Tokens with a cache that is not exact here [N]: candidates for recomputation."""
        return self.token_mask(lambda p: p.reusable)

    def placement(self, adapter: FusionModel) -> KVPlacement:
        """Where each layer's packed caches go (`KVPlacement`), the same for every layer: made once."""
        shape = (2, adapter.layout.n_kv_heads, self.n_tokens, adapter.layout.head_dim)  # [2, H_kv, N, D]
        cached = [p for p in self.parts if p.kv is not None]
        device = self.ids.device
        spans = [np.arange(p.start, p.end) for p in cached]  # laid out on the host, sent in one copy
        positions = torch.from_numpy(np.concatenate(spans) if spans else np.zeros(0, np.int64)).to(device)  # [C]
        offsets = [0]  # where each cached segment starts in the pack
        runs: list[tuple[int, int, int]] = []  # (prompt start, pack start, length), adjacent segments merged
        for p in cached:
            if runs and runs[-1][0] + runs[-1][2] == p.start:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + len(p.segment.ids))
            else:
                runs.append((p.start, offsets[-1], len(p.segment.ids)))
            offsets.append(offsets[-1] + len(p.segment.ids))
        starts = tuple(p.start for p in cached)
        moved = [i for i, p in enumerate(cached) if p.start != p.kv.position]
        if not moved:
            return KVPlacement(shape, adapter.dtype, positions, tuple(runs), starts)
        start, end = offsets[moved[0]], offsets[moved[-1] + 1]
        delta = np.zeros(end - start, np.int64)  # [M], zero for the segments in the span that stay
        for i in moved:
            delta[offsets[i] - start : offsets[i + 1] - start] = cached[i].start - cached[i].kv.position
        turn = rotation(torch.from_numpy(delta), adapter.inv_freq.to(device))  # cos, sin [M, D]
        return KVPlacement(shape, adapter.dtype, positions, tuple(runs), starts, start, end, *turn)


@dataclass(frozen=True)
class KVPlacement:
    """Where a prompt's cached K/V go, laid out once per prompt on the device. A layer's caches arrive
    packed in segment order (`cache.pack_layer`, [2, H_kv, C, D]); packed keys [turn_start, turn_end)
    hold every moved segment and are turned to their prompt positions by `rotation`'s cos/sin [M, D] (RoPE
    re-rotation, the same for every layer; identity for the segments in that span that stay); then
    the pack goes to its prompt positions in the layer's buffer `shape` [2, H_kv, N, D]: on CUDA one
    index_copy over `positions` [C] (one kernel); elsewhere one slice copy per run of adjacent cached
    segments (`runs`), which on a CPU costs a fraction of an indexed copy (benchmarks/RESULTS.md, issue
    30). Tokens without a cache are not written: the fusion computes them (they are in
    every layer's active set) before anything reads them."""

    shape: tuple[int, int, int, int]  # [2, H_kv, N, D]
    dtype: torch.dtype
    positions: torch.Tensor  # [C], prompt position of each packed token
    runs: tuple[tuple[int, int, int], ...]  # (prompt start, pack start, length) of each run of cached tokens
    starts: tuple[int, ...]  # prompt start of each cached segment, in pack order
    turn_start: int = 0
    turn_end: int = 0
    cos: torch.Tensor | None = None  # [M, D], M = turn_end - turn_start
    sin: torch.Tensor | None = None  # [M, D]

    def assemble(self, packed: torch.Tensor | None, pool: KVBufferPool) -> torch.Tensor:
        """One layer's K/V of the prompt [2, H_kv, N, D] in a buffer from `pool`, `packed` placed in it."""
        return self.place(packed, pool.take(self.shape, self.dtype, self.positions.device))

    def place(self, packed: torch.Tensor | None, kv: torch.Tensor) -> torch.Tensor:
        """Rotate the moved keys of `packed` [..., 2, H_kv, C, D] in place and write the pack into the
        layer's (or layers') K/V kv [..., 2, H_kv, N, D]; returns kv."""
        if packed is None:
            return kv
        if self.cos is not None:
            span = packed[..., 0, :, self.turn_start : self.turn_end, :]  # [..., H_kv, M, D]
            rotate_keys(span, self.cos, self.sin, out=span)
        if kv.device.type == "cuda":
            return kv.index_copy_(-2, self.positions, packed.to(kv.dtype))  # [..., 2, H_kv, N, D]
        for start, at, n in self.runs:
            kv[..., start : start + n, :] = packed[..., at : at + n, :]  # [..., 2, H_kv, n, D]
        return kv

    def place_whole(self, sources: Sequence[torch.Tensor], kv: torch.Tensor) -> torch.Tensor:
        """`place` for every layer at once, without a pack: each cached segment's layers `sources` [L, 2, H_kv,
        T_i, D] (in pack order, `cache.all_layers`) copied straight to its prompt positions in kv [L, 2, H_kv, N,
        D], then the moved keys rotated there, one call a run of adjacent segments; returns kv. A copy and a
        rotation a segment per prompt, whatever the number of layers."""
        for start, layers in zip(self.starts, sources):
            kv[..., start : start + layers.shape[-2], :] = layers  # [L, 2, H_kv, T_i, D]
        cos, sin = self.cos, self.sin  # [M, D] each
        if cos is None or sin is None:
            return kv
        for start, at, n in self.runs:
            lo, hi = max(at, self.turn_start), min(at + n, self.turn_end)  # the run's moved part, pack coordinates
            if lo < hi:
                span = kv[:, 0, :, start + lo - at : start + hi - at]  # [L, H_kv, hi - lo, D]
                turn = slice(lo - self.turn_start, hi - self.turn_start)
                rotate_keys(span, cos[turn], sin[turn], out=span)
        return kv


class LayerReader(Protocol):
    """Delivers each layer's K/V of the whole prompt [2, H_kv, N, D], in layer order, with every cached
    token in place and its key re-rotated (`KVPlacement.assemble`); the other positions are the
    fusion's to write. `fill` writes the layers left, from the next one, into memory of the caller's
    [L', 2, H_kv, N, D] (a captured step's static buffers, `graphs.LayerStep`)."""

    def get(self, layer: int) -> torch.Tensor: ...
    def fill(self, layers: range, out: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DirectReader:
    """Reads and assembles each layer when asked, in the caller's thread (no overlap with the compute);
    buffers come from `pool` (default: none kept, each one new)."""

    sources: Sequence[LayerSource | None]
    placement: KVPlacement
    pool: KVBufferPool = field(default_factory=lambda: KVBufferPool(0))

    def get(self, layer: int) -> torch.Tensor:
        return self.placement.assemble(pack_layer(self.sources, layer, self.placement.positions.device), self.pool)

    def fill(self, layers: range, out: torch.Tensor) -> None:
        self.placement.place(pack_layers(self.sources, layers, self.placement.positions.device), out)


@dataclass
class WholeReader:
    """Assembles every layer of the prompt at once, at the first `get`, in the caller's thread
    (`KVPlacement.place_whole`): for caches already in memory (`cache.resident`), where a read is a copy and
    a reader thread would only contend with the fusion for the cores. One [L, 2, H_kv, N, D] buffer from
    `pool`; `get(layer)` is a view of it."""

    sources: Sequence[LayerSource | None]
    placement: KVPlacement
    n_layers: int
    pool: KVBufferPool = field(default_factory=lambda: KVBufferPool(0))
    _kv: torch.Tensor | None = field(default=None, init=False, repr=False)  # [L, 2, H_kv, N, D], once assembled

    def get(self, layer: int) -> torch.Tensor:
        return self.whole()[layer]  # [2, H_kv, N, D]

    def fill(self, layers: range, out: torch.Tensor) -> None:
        out.copy_(self.whole()[layers.start : layers.stop])  # [L', 2, H_kv, N, D]

    def whole(self) -> torch.Tensor:
        """Every layer's K/V [L, 2, H_kv, N, D], assembled at the first call."""
        if self._kv is None:
            device = self.placement.positions.device
            kv = self.pool.take((self.n_layers, *self.placement.shape), self.placement.dtype, device)
            cached = [all_layers(s).to(device) for s in self.sources if s is not None]  # [L, 2, H_kv, T_i, D]
            self._kv = self.placement.place_whole(cached, kv)  # [L, 2, H_kv, N, D]
        return self._kv


@dataclass
class FusionResult:
    keys: list[torch.Tensor]  # L x [H_kv, N, D]
    values: list[torch.Tensor]  # L x [H_kv, N, D]
    logits: torch.Tensor  # [V], next-token logits after the last prompt token
    recomputed_tokens: int  # tokens whose K/V the last layer computes (question included)
    compute_fraction: float  # token-layers through attention and MLP / (N x layers): the work relative to `full`
    active_per_layer: list[int] = field(default_factory=list)  # tokens whose K/V each layer computes
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the prefill


class Refine(Protocol):
    def __call__(
        self,
        layer: int,
        active: torch.Tensor,
        fresh_kv: tuple[torch.Tensor, torch.Tensor],
        layer_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None: ...


@torch.inference_mode()
def selective_prefill(
    adapter: FusionModel,
    inp: FusionInput,
    initial: torch.Tensor,
    refine: Refine | None = None,
    clock: StageClock | None = None,
    reader: LayerReader | None = None,
    settled: int | None = None,
    picks: tuple[Pick, ...] = (),
    which: int = 0,
) -> FusionResult:
    """Layer-wise forward computing only `initial` token indices (narrowed by `refine` within a layer).

    `refine(layer, active, fresh_kv, layer_cache)` runs after a layer's K/V projections, with the
    active tokens' fresh K/V [H_kv, A, D] and the layer's cache [H_kv, N, D] before the fresh K/V are
    written into it (it gathers only what it compares), and may return the positions *within*
    `active` that go on through that layer's attention and MLP and all later layers (CacheBlend picks
    its tokens at the check layer's K/V, as LMCache's blender does). The fresh K/V of the tokens it
    drops stay in that layer's cache. The active set can only shrink and must keep the last prompt token.
    Q is projected after `refine`, for the tokens that go on only; once the set is settled a layer's q, k
    and v come from one projection (`graphs.settled_layers`). The last layer computes the K/V of
    its active tokens, but Q, attention and MLP for the last token alone: nothing else reads their
    output (the logits are the last token's).
    `reader` delivers each layer's K/V with the cached tokens assembled (default: read when needed,
    in this thread, into new memory); the time spent waiting for them and placing them is the stage
    `kv_wait`.
    `settled` is the first layer from which `refine` returns None (default: 0 without a `refine`, else
    none): from there the active set is fixed and the layers run as `graphs.settled_layers`, op by op, or
    with `adapter.graphs` as one step over static buffers, the model's head included (`graphs.LayerGraphs`:
    on CUDA one captured graph), the stage `layers`. The checks of the active set (one device sync), the
    RoPE tables and the embedding before the first layer are the stage `setup`.
    `picks` (with `adapter.graphs` only; no `refine`): the active set narrowed at fixed counts (`interface.Pick`,
    by the deviation of K, `which` 0, or V), every layer one captured step from the first.
    """
    if picks and (refine is not None or adapter.graphs is None):
        raise ValueError("picks run in a captured step (adapter.graphs), without a refine")
    clock = clock or StageClock(adapter.device)
    reader = reader or DirectReader(inp.sources, inp.placement(adapter))
    n, layout = inp.n_tokens, adapter.layout
    if adapter.sliding_window is not None and n > adapter.sliding_window:
        raise ValueError(f"prompt of {n} tokens exceeds the model's sliding window {adapter.sliding_window}")
    with clock.stage("setup"):
        if initial.numel() == 0:
            raise ValueError("the active set must include the last prompt token")
        last_in, fresh_in = torch.stack([initial[-1] == n - 1, inp.fresh[initial].sum() == inp.fresh.sum()]).tolist()
        if not last_in:  # both read in one sync, before the layer loop
            raise ValueError("the active set must include the last prompt token")
        if not fresh_in:
            raise ValueError("the active set must include every token without a cache (they are computed, not read)")
        positions = torch.arange(n, device=inp.ids.device)  # [N]
        cos_all, sin_all = rope_cos_sin(positions, adapter.inv_freq.to(positions.device), adapter.dtype)  # [N, D]
        active = initial  # [A], token positions in ascending order
        h = adapter.embed(inp.ids[active])  # [A, E]
    keys_all, values_all = [], []  # L x [H_kv, N, D]
    counts, through = [], 0  # tokens whose K/V each layer computes; token-layers through attention and MLP
    plan = None  # the attention plan of the active set, made again when the set changes
    rope = active, cos_all[active], sin_all[active]  # the active set's cos/sin [A, D], gathered again when it changes
    group, last = adapter.n_q_heads // layout.n_kv_heads, layout.n_layers - 1
    if picks:
        settled = 0  # the step runs every layer
    elif settled is None:
        settled = 0 if refine is None else layout.n_layers
    dropped: list[torch.Tensor] = []  # per narrowing: did `refine` drop the last prompt token? [] each
    for layer in range(settled):  # the layers where `refine` may narrow the active set
        with clock.stage("kv_wait"):  # what the reader's read-ahead did not hide
            keys, values = reader.get(layer).unbind(0)  # [H_kv, N, D], cached tokens in place
        keys_all.append(keys)
        values_all.append(values)
        with clock.stage("qkv"):  # Q after `refine` and the last layer's narrowing, for the tokens that go on only
            x = adapter.attention_input(layer, h)  # [A, E]
            k, v = adapter.kv(layer, x, *rope[1:])  # [H_kv, A, D] x 2
        with clock.stage("select"):
            keep = None if refine is None else refine(layer, active, (k, v), (keys, values))  # [A'] into active
        with clock.stage("qkv"):
            keys.index_copy_(1, active, k)  # every computed token's fresh K/V, kept by `refine` or not
            values.index_copy_(1, active, v)
            if keep is not None:
                if keep.numel() == 0:
                    raise ValueError(f"refine at layer {layer} kept no token")
                dropped.append(keep[-1] != active.numel() - 1)  # [], checked after the forward: no sync here
                active, h, x = active[keep], h[keep], x[keep]  # [A'], [A', E], [A', E]
            counts.append(active.numel())
            if layer == last:  # only the last token's output is read, by the logits
                active, h, x = active[-1:], h[-1:], x[-1:]  # [1], [1, E], [1, E]
            if rope[0] is not active:
                rope = active, cos_all[active], sin_all[active]  # [A'], [A', D], [A', D]
            q = adapter.q(layer, x, *rope[1:])  # [H_q, A', D]
        with clock.stage("attention"):
            if plan is None or plan.positions is not active:
                plan = attention_plan(active, n, group, q.dtype)
            attn = causal_attend(q, keys, values, plan, adapter.scale)  # [A, H_q * D]
        with clock.stage("mlp"):
            h = adapter.finish(layer, h, attn)  # [A, E]
        through += active.numel()
    rest = range(settled, layout.n_layers)  # the active set fixed from here
    logits = None  # [V], the step's output when the settled layers run as one
    if rest and adapter.graphs is not None:
        with clock.stage("layers"):  # the reads that fill the step's buffers, and the model's head, included
            forced = inp.fresh[active] if picks else None  # [A]
            at = StepInput(settled, h, active, *rope[1:], n, picks, forced, which)
            logits, kv = adapter.graphs.run(at, lambda out: reader.fill(rest, out))  # [V], [L', 2, H_kv, N, D]
        keys_all.extend(kv[:, 0].unbind(0))  # L' x [H_kv, N, D]
        values_all.extend(kv[:, 1].unbind(0))
    elif rest:

        def layer_kv(layer: int) -> torch.Tensor:
            with clock.stage("kv_wait"):
                kv = reader.get(layer)  # [2, H_kv, N, D]
            keys_all.append(kv[0])
            values_all.append(kv[1])
            return kv

        if plan is None or plan.positions is not active:  # the last selecting layer's plan holds
            plan = attention_plan(active, n, group, adapter.dtype)
        last_plan = attention_plan(active[-1:], n, group, adapter.dtype)
        h = settled_layers(adapter, rest, h, active, *rope[1:], layer_kv, plan, last_plan, clock)  # [1, E]
    kept = {p.layer: p.keep for p in picks}
    sizes = list(itertools.accumulate(rest, lambda a, layer: kept.get(layer, a), initial=active.numel()))[1:]
    counts.extend(sizes)  # the tokens whose K/V each layer from `settled` computes (narrowed at the picks' layers)
    through += sum(sizes[:-1]) + 1 if rest else 0  # the last layer's attention and MLP: the last token alone
    if logits is None:
        with clock.stage("logits"):
            logits = adapter.logits(h)[0]  # [V]
    if dropped and bool(torch.stack(dropped).any()):  # the one sync for every narrowing, once the forward is queued
        raise ValueError("refine dropped the last prompt token")
    return FusionResult(
        keys_all,
        values_all,
        logits,
        counts[-1],
        through / (n * layout.n_layers),
        counts,
        dict(clock.seconds),
    )
