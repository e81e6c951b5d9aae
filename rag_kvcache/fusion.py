"""Fusion methods: turn retrieved chunk caches into one KV cache for the whole prompt.

Every method has the same signature, `(adapter, FusionInput, FusionConfig) -> FusionResult`, and is
registered by name. All but `full` run one engine, `selective_prefill`: a layer-by-layer forward in
which only an *active* set of tokens is computed; every other token's K/V comes from its (RoPE
re-rotated) chunk cache. A method is just the rule that picks the active set:

- `prefix`     every token after the exactly-cached head (system prefix, and chunk 1 when chunks are
               prefilled behind the prefix): exact, equals `full`.
- `reuse`      only tokens without a cache (separators, question).
- `epic`       EPIC LegoLink-k: additionally the first k tokens of every inexact chunk.
- `cacheblend` CacheBlend: all non-exact tokens up to the check layer, then only the tokens whose
               K (or V) deviates most from the cache (HKVD), narrowed gradually over `filter_steps`.

Recomputed tokens attend with the exact causal mask over their original positions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .config import FusionConfig
from .loading import LayerFeed, LayerKV, read_layer
from .model import ModelAdapter
from .ops import causal_attend, kv_deviation, rerotate_keys, rope_cos_sin, select_tokens
from .profiling import StageClock
from .prompt import Segment
from .storage import LayerSource


@dataclass(frozen=True)
class SegmentKV:
    """A prompt segment, where it starts, and its cache (None: computed at query time)."""

    segment: Segment
    start: int
    kv: LayerSource | None  # a `ChunkKV` in memory or a store entry whose layers are read on demand
    exact: bool  # cache equals what a full prefill computes here (same position, same tokens before)


@dataclass
class FusionInput:
    """The prompt's tokens and its segments' caches.

    `prefetch` > 0 reads cached layers in a background thread that runs that many layers ahead of
    the fusion (a `LayerFeed`, started when layer 0 is asked for); 0 reads each layer when asked.
    `close()` stops a reader the fusion did not drain (the pipeline calls it).
    """

    ids: torch.Tensor  # [N]
    parts: list[SegmentKV]
    prefetch: int = 0
    _feed: LayerFeed | None = field(default=None, init=False, repr=False)
    _waited_s: float = field(default=0.0, init=False, repr=False)

    @classmethod
    def build(
        cls, segments: list[Segment], caches: list[LayerSource | None], contexts: list[tuple[int, ...]],
        device: torch.device | str = "cpu", prefetch: int = 0,
    ) -> FusionInput:
        """Lay segments out in order; `contexts[i]` are the tokens segment i's cache was computed behind."""
        if not (len(segments) == len(caches) == len(contexts)):
            raise ValueError(f"{len(segments)} segments, {len(caches)} caches, {len(contexts)} contexts")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch!r}")
        ids: list[int] = []
        parts = []
        for seg, kv, ctx in zip(segments, caches, contexts):
            if kv is not None and kv.n_tokens != len(seg.ids):
                raise ValueError(f"cache of segment {seg.label!r} has {kv.n_tokens} tokens, segment has {len(seg.ids)}")
            exact = kv is not None and kv.position == len(ids) and tuple(ids) == tuple(ctx)
            parts.append(SegmentKV(seg, len(ids), kv, exact))
            ids.extend(seg.ids)
        if not parts or parts[-1].kv is not None:
            raise ValueError("the prompt must end with an uncached segment (the question)")
        return cls(torch.tensor(ids, dtype=torch.long, device=device), parts, prefetch)

    @property
    def n_tokens(self) -> int:
        return self.ids.numel()

    @property
    def load_wait_s(self) -> float:
        """Seconds `layer_kv` spent waiting for cached layers to be read (all of the reading when
        `prefetch` is 0; what the recompute did not hide otherwise)."""
        return self._waited_s + (self._feed.wait_s if self._feed is not None else 0.0)

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._waited_s += self._feed.wait_s
            self._feed = None

    def token_mask(self, pred: Callable[[SegmentKV], bool]) -> torch.Tensor:
        mask = torch.zeros(self.n_tokens, dtype=torch.bool, device=self.ids.device)  # [N]
        for p in self.parts:
            if pred(p):
                mask[p.start : p.start + len(p.segment.ids)] = True
        return mask

    @property
    def fresh(self) -> torch.Tensor:
        """Tokens with no cache [N]: always recomputed."""
        return self.token_mask(lambda p: p.kv is None)

    @property
    def reusable(self) -> torch.Tensor:
        """Tokens with a cache that is not exact here [N]: candidates for recomputation."""
        return self.token_mask(lambda p: p.kv is not None and not p.exact)

    def _read(self, layer: int, adapter: ModelAdapter) -> LayerKV:
        sources = [p.kv for p in self.parts]
        if self.prefetch == 0:
            start = time.perf_counter()
            loaded = read_layer(sources, layer, self.ids.device)
            self._waited_s += time.perf_counter() - start
            return loaded
        if layer == 0:
            self.close()
            self._feed = LayerFeed(sources, adapter.layout.n_layers, self.ids.device, self.prefetch)
        if self._feed is None:
            raise ValueError(f"layer {layer} asked for before layer 0: a prefetching input is read in order")
        return self._feed.get(layer)

    def layer_kv(self, layer: int, adapter: ModelAdapter) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K/V of one layer for the whole prompt [H_kv, N, D], keys moved to their prompt positions.

        Tokens without a cache hold zeros; they are always recomputed before anything reads them.
        """
        h, d, dtype = adapter.layout.n_kv_heads, adapter.layout.head_dim, adapter.dtype
        keys, values = [], []
        for p, loaded in zip(self.parts, self._read(layer, adapter)):
            n = len(p.segment.ids)
            if loaded is None:
                keys.append(torch.zeros(h, n, d, dtype=dtype, device=self.ids.device))  # [H_kv, n, D]
                values.append(keys[-1])
                continue
            k = loaded[0].to(self.ids.device, dtype)  # [H_kv, n, D]
            shift = p.start - p.kv.position
            keys.append(rerotate_keys(k, shift, adapter.inv_freq) if shift else k)  # [H_kv, n, D]
            values.append(loaded[1].to(self.ids.device, dtype))  # [H_kv, n, D]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [H_kv, N, D]


@dataclass
class FusionResult:
    keys: list[torch.Tensor]  # L x [H_kv, N, D]
    values: list[torch.Tensor]  # L x [H_kv, N, D]
    logits: torch.Tensor  # [V], next-token logits after the last prompt token
    recomputed_tokens: int  # tokens computed through the last layer (question included)
    compute_fraction: float  # token-layers through attention and MLP / (N x layers): the work relative to `full`
    active_per_layer: list[int] = field(default_factory=list)  # tokens through each layer's attention and MLP
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the prefill


class Refine(Protocol):
    def __call__(
        self, layer: int, active: torch.Tensor, fresh_kv: tuple[torch.Tensor, torch.Tensor],
        layer_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None: ...


@torch.inference_mode()
def selective_prefill(
    adapter: ModelAdapter, inp: FusionInput, initial: torch.Tensor, refine: Refine | None = None,
    clock: StageClock | None = None,
) -> FusionResult:
    """Layer-wise forward computing only `initial` token indices (narrowed by `refine` within a layer).

    `refine(layer, active, fresh_kv, layer_cache)` runs after a layer's Q/K/V projections, with the
    active tokens' fresh K/V [H_kv, A, D] and the layer's cache [H_kv, N, D] before the fresh K/V are
    written into it (it gathers only what it compares), and may return the positions *within*
    `active` that go on through that layer's attention and MLP and all later layers (CacheBlend picks
    its tokens at the check layer's K/V, as LMCache's blender does). The fresh K/V of the tokens it
    drops stay in that layer's cache. The active set can only shrink and must keep the last prompt token.
    """
    clock = clock or StageClock(adapter.device)
    n, n_layers = inp.n_tokens, adapter.layout.n_layers
    if adapter.sliding_window is not None and n > adapter.sliding_window:
        raise ValueError(f"prompt of {n} tokens exceeds the model's sliding window {adapter.sliding_window}")
    if initial.numel() == 0 or initial[-1].item() != n - 1:
        raise ValueError("the active set must include the last prompt token")
    positions = torch.arange(n, device=inp.ids.device)  # [N]
    cos_all, sin_all = rope_cos_sin(positions, adapter.inv_freq.to(positions.device))  # [N, D]
    active = initial  # [A], token positions in ascending order
    h = adapter.embed(inp.ids[active])  # [A, E]
    keys_out, values_out, counts = [], [], []
    for layer in range(n_layers):
        with clock.stage("assemble_kv"):
            keys, values = inp.layer_kv(layer, adapter)  # [H_kv, N, D], cached keys re-rotated
        with clock.stage("qkv"):
            q, k, v = adapter.qkv(layer, h, cos_all[active], sin_all[active])  # [H_q, A, D], [H_kv, A, D]
        keep = None
        if refine is not None:
            with clock.stage("select"):
                keep = refine(layer, active, (k, v), (keys, values))  # [A'] indices into active
        with clock.stage("qkv"):
            keys[:, active] = k  # every computed token's fresh K/V, kept by `refine` or not
            values[:, active] = v
        if keep is not None:
            if keep.numel() == 0 or keep[-1].item() != active.numel() - 1:
                raise ValueError(f"refine at layer {layer} dropped the last prompt token")
            active, h, q = active[keep], h[keep], q[:, keep]  # [A'], [A', E], [H_q, A', D]
        with clock.stage("attention"):
            attn = causal_attend(q, keys, values, active, adapter.scale)  # [A, H_q * D]
        with clock.stage("mlp"):
            h = adapter.finish(layer, h, attn)  # [A, E]
        keys_out.append(keys)
        values_out.append(values)
        counts.append(active.numel())
    with clock.stage("logits"):
        logits = adapter.logits(h[-1:])[0]  # [V]
    return FusionResult(
        keys_out, values_out, logits, active.numel(), sum(counts) / (n * n_layers), counts, dict(clock.seconds)
    )


# ---- the registry ---------------------------------------------------------------------------------
FusionMethod = Callable[[ModelAdapter, FusionInput, FusionConfig], FusionResult]
METHODS: dict[str, FusionMethod] = {}


def register(name: str) -> Callable[[FusionMethod], FusionMethod]:
    def deco(fn: FusionMethod) -> FusionMethod:
        METHODS[name] = fn
        return fn

    return deco


def get_method(name: str) -> FusionMethod:
    if name not in METHODS:
        raise ValueError(f"unknown fusion method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


@register("full")
@torch.inference_mode()
def full(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig) -> FusionResult:
    """Ordinary prefill of the whole prompt: the quality reference; uses no cache."""
    clock = StageClock(adapter.device)
    with clock.stage("prefill"):
        keys, values, logits = adapter.prefill(inp.ids[None])
    n = inp.n_tokens
    return FusionResult(
        [k[0] for k in keys], [v[0] for v in values], logits[0], n, 1.0, [n] * adapter.layout.n_layers,
        dict(clock.seconds),
    )


@register("prefix")
def prefix(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig) -> FusionResult:
    """Prefix caching: reuse the exactly-cached head, prefill everything after it."""
    return selective_prefill(adapter, inp, (inp.fresh | inp.reusable).nonzero()[:, 0])


@register("reuse")
def reuse(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig) -> FusionResult:
    """Full KV reuse: every chunk cache position-corrected, only uncached tokens computed."""
    return selective_prefill(adapter, inp, inp.fresh.nonzero()[:, 0])


@register("epic")
def epic(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig) -> FusionResult:
    """EPIC LegoLink-k: recompute the first k tokens of every inexact chunk, plus uncached tokens."""
    heads = inp.token_mask(lambda p: False)  # [N]
    for p in inp.parts:
        if p.kv is not None and not p.exact:
            heads[p.start : p.start + min(cfg.epic_k, len(p.segment.ids))] = True
    return selective_prefill(adapter, inp, (inp.fresh | heads).nonzero()[:, 0])


def filter_schedule(cfg: FusionConfig, n_layers: int) -> dict[int, float]:
    """Layer -> fraction of reusable tokens kept from its attention on (gradual filtering, §4.3 of CacheBlend)."""
    last = cfg.check_layer + cfg.filter_steps - 1
    if last >= n_layers:
        raise ValueError(f"check layer {cfg.check_layer} with {cfg.filter_steps} filter step(s) reaches layer {last}, "
                         f"beyond the model's {n_layers} layers (0..{n_layers - 1})")
    if cfg.filter_steps == 1:
        return {cfg.check_layer: cfg.ratio}
    first = min(1.0, 2 * cfg.ratio)
    step = (first - cfg.ratio) / (cfg.filter_steps - 1)
    return {cfg.check_layer + s: first - s * step for s in range(cfg.filter_steps)}


@register("cacheblend")
def cacheblend(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig) -> FusionResult:
    """CacheBlend selective recompute of the high-KV-deviation tokens."""
    fresh, reusable = inp.fresh, inp.reusable  # [N]
    n_reusable = int(reusable.sum())
    schedule = filter_schedule(cfg, adapter.layout.n_layers)
    which = 0 if cfg.deviation == "k" else 1

    def refine(layer: int, active: torch.Tensor, fresh_kv, layer_cache) -> torch.Tensor | None:
        if layer not in schedule:
            return None
        forced = fresh[active]  # [A]
        score = kv_deviation(fresh_kv[which], layer_cache[which][:, active])  # [A]
        score[forced] = math.inf
        n_keep = int(forced.sum()) + round(schedule[layer] * n_reusable)
        return select_tokens(score, n_keep)  # [A']

    return selective_prefill(adapter, inp, (fresh | reusable).nonzero()[:, 0], refine)
