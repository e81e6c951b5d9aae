"""Fusion methods, registered by name: each turns a prompt's chunk caches into one KV cache.

Every method has the same signature, `(adapter, FusionInput, FusionConfig, clock, reader) ->
FusionResult`. All but `full` run one engine, `selective_prefill`; a method is just the rule that
picks the tokens it computes:

- `prefix`     every token after the exactly-cached head (system prefix, and chunk 1 when chunks are
               prefilled behind the prefix): exact, equals `full`.
- `reuse`      only tokens without a cache (separators, question).
- `epic`       EPIC LegoLink-k: additionally the first k tokens of every inexact chunk.
- `epic_match` EPIC, and every sentence of an inexact chunk that restates what the question asks about
               (`match_words` question words) after an earlier such sentence in the prompt.
- `cacheblend` CacheBlend: all non-exact tokens up to the check layer, then only the tokens whose
               K (or V) deviates most from the cache (HKVD), narrowed gradually over `filter_steps`.

A new method is one function decorated with `@register("name")`; the CLI, the bench and the
integrations find it by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import FusionConfig
from .fusion import FusionInput, FusionResult, LayerReader, selective_prefill
from .interface import FusionModel, Pick
from .model import ModelAdapter
from .ops import kv_deviation, select_tokens
from .profiling import StageClock
from .sentences import echo_sentences

MethodFn = Callable[[FusionModel, FusionInput, FusionConfig, "StageClock | None", "LayerReader | None"], FusionResult]


@dataclass(frozen=True)
class Method:
    """A registered fusion method; `reads_cache` is False for methods that compute every token, `exact`
    True for those whose K/V equal a full prefill's over the caches they read (to float rounding)."""

    name: str
    fn: MethodFn
    reads_cache: bool = True
    exact: bool = False

    def __call__(
        self,
        adapter: FusionModel,
        inp: FusionInput,
        cfg: FusionConfig,
        clock: StageClock | None = None,
        reader: LayerReader | None = None,
    ) -> FusionResult:
        return self.fn(adapter, inp, cfg, clock, reader)


METHODS: dict[str, Method] = {}


def register(name: str, reads_cache: bool = True, exact: bool = False) -> Callable[[MethodFn], MethodFn]:
    """Register a fusion method under `name` (replacing any method of that name)."""

    def deco(fn: MethodFn) -> MethodFn:
        METHODS[name] = Method(name, fn, reads_cache, exact)
        return fn

    return deco


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown fusion method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


@register("full", reads_cache=False, exact=True)
@torch.inference_mode()
def full(adapter: ModelAdapter, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """Ordinary prefill of the whole prompt: the quality reference; uses no cache."""
    clock = clock or StageClock(adapter.device)
    with clock.stage("prefill"):
        keys, values, logits = adapter.prefill(inp.ids[None])
    n = inp.n_tokens
    return FusionResult(
        [k[0] for k in keys],
        [v[0] for v in values],
        logits[0],
        n,
        1.0,
        [n] * adapter.layout.n_layers,
        dict(clock.seconds),
    )


@register("prefix", exact=True)
def prefix(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """Prefix caching: reuse the exactly-cached head, prefill everything after it."""
    return selective_prefill(adapter, inp, (inp.fresh | inp.reusable).nonzero()[:, 0], clock=clock, reader=reader)


@register("reuse")
def reuse(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """Full KV reuse: every chunk cache position-corrected, only uncached tokens computed."""
    return selective_prefill(adapter, inp, inp.fresh.nonzero()[:, 0], clock=clock, reader=reader)


def chunk_heads(inp: FusionInput, k: int | None) -> torch.Tensor:
    """The first k tokens of every inexact chunk [N] (EPIC's LegoLink heads)."""
    if k is None:
        raise ValueError("epic_k is unset: set it for the index's chunk size first (FusionConfig.for_chunks)")
    heads = inp.token_mask(lambda p: False)  # [N]
    for p in inp.parts:
        if p.kv is not None and not p.exact:
            heads[p.start : p.start + min(k, len(p.segment.ids))] = True
    return heads


@register("epic")
def epic(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """EPIC LegoLink-k: recompute the first k tokens of every inexact chunk, plus uncached tokens."""
    return selective_prefill(
        adapter, inp, (inp.fresh | chunk_heads(inp, cfg.epic_k)).nonzero()[:, 0], clock=clock, reader=reader
    )


@register("epic_match")
def epic_match(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """EPIC, and the sentences of inexact chunks that echo the question (`sentences.echo_sentences`: they
    share `match_words` words with it and an earlier sentence of the prompt does too), recomputed so
    that each attends to the earlier ones as in a full prefill and the question's subject binds to its own."""
    return selective_prefill(
        adapter, inp, epic_match_tokens(adapter, inp, cfg).nonzero()[:, 0], clock=clock, reader=reader
    )


def epic_match_tokens(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig) -> torch.Tensor:
    """The tokens `epic_match` computes [N]: the uncached ones, the chunk heads and the echoing sentences."""
    chunks = inp.token_mask(lambda p: p.kv is not None and p.start > 0)  # [N], the cached head at 0 is no chunk
    question = inp.token_mask(lambda p: p is inp.parts[-1])  # [N]
    echoes = echo_sentences(inp.ids, adapter.lexicon, inp.segment_of, chunks, question, cfg.match_words)  # [N]
    return inp.fresh | chunk_heads(inp, cfg.epic_k) | (echoes & inp.reusable)  # [N]


def filter_schedule(cfg: FusionConfig, n_layers: int) -> dict[int, float]:
    """Layer -> fraction of reusable tokens kept from its attention on (gradual filtering, §4.3 of CacheBlend)."""
    last = cfg.check_layer + cfg.filter_steps - 1
    if last >= n_layers:
        raise ValueError(
            f"check layer {cfg.check_layer} with {cfg.filter_steps} filter step(s) reaches layer {last}, "
            f"beyond the model's {n_layers} layers (0..{n_layers - 1})"
        )
    if cfg.filter_steps == 1:
        return {cfg.check_layer: cfg.ratio}
    first = min(1.0, 2 * cfg.ratio)
    step = (first - cfg.ratio) / (cfg.filter_steps - 1)
    return {cfg.check_layer + s: first - s * step for s in range(cfg.filter_steps)}


def hkvd_prefill(
    adapter: FusionModel,
    inp: FusionInput,
    cfg: FusionConfig,
    schedule: dict[int, float],
    clock=None,
    reader=None,
) -> FusionResult:
    """Selective prefill that, at each layer of `schedule`, keeps its fraction of the reusable tokens whose
    fresh K (or V, `cfg.deviation`) deviates most from the cache there (the HKVD tokens), plus every
    uncached token; all non-exact tokens are computed up to the first such layer. With `adapter.graphs`
    the whole forward is one captured step (`interface.Pick`: the counts kept are known before it starts),
    unless a pick is at the last layer."""
    fresh, reusable = inp.fresh, inp.reusable  # [N]
    n_fresh, n_reusable = inp.count(lambda p: p.fresh), inp.count(lambda p: p.reusable)  # on the host: no sync
    which = 0 if cfg.deviation == "k" else 1
    initial = (fresh | reusable).nonzero()[:, 0]  # [A]
    keeps, n = {}, n_fresh + n_reusable  # layer -> tokens kept from it; the active set only shrinks
    for layer in sorted(schedule):
        keeps[layer] = n = min(n, n_fresh + round(schedule[layer] * n_reusable))
    if adapter.graphs is not None and max(schedule) < adapter.layout.n_layers - 1:
        picks = tuple(Pick(layer, keep) for layer, keep in keeps.items())
        return selective_prefill(adapter, inp, initial, clock=clock, reader=reader, picks=picks, which=which)

    def refine(layer: int, active: torch.Tensor, fresh_kv, layer_cache) -> torch.Tensor | None:
        if layer not in schedule:
            return None
        score = kv_deviation(fresh_kv[which], layer_cache[which][:, active])  # [A]
        score.masked_fill_(fresh[active], math.inf)  # every uncached token is active, and kept
        return select_tokens(score, keeps[layer])  # [A']

    return selective_prefill(adapter, inp, initial, refine, clock=clock, reader=reader, settled=max(schedule) + 1)


@register("cacheblend")
def cacheblend(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """CacheBlend selective recompute of the high-KV-deviation tokens."""
    return hkvd_prefill(adapter, inp, cfg, filter_schedule(cfg, adapter.layout.n_layers), clock, reader)


def repick_schedule(cfg: FusionConfig, n_layers: int) -> dict[int, float]:
    """Layer -> fraction of reusable tokens kept from its attention on, for `cacheblend_repick`: a pick at
    the check layer and a narrower re-pick at each of `repick_layers`, each keeping `repick_decay` times the
    fraction before it. The first fraction is solved so that the reusable token-layers equal CacheBlend's
    at `ratio` ((n_layers - check_layer) * ratio); it is capped at 1, which can only lower the total."""
    layers = (cfg.check_layer, *cfg.repick_layers)
    if list(layers) != sorted(set(layers)) or layers[-1] >= n_layers:
        raise ValueError(
            f"repick layers {cfg.repick_layers} must rise strictly after the check layer "
            f"{cfg.check_layer} and stay below the model's {n_layers} layers"
        )
    spans = [b - a for a, b in zip(layers, (*layers[1:], n_layers))]  # layers each fraction lasts
    weight = sum(span * cfg.repick_decay**j for j, span in enumerate(spans))
    first = min(1.0, (n_layers - cfg.check_layer) * cfg.ratio / weight)
    return {layer: first * cfg.repick_decay**j for j, layer in enumerate(layers)}


@register("cacheblend_repick")
def cacheblend_repick(
    adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None
) -> FusionResult:
    """CacheBlend with re-selection: pick more HKVD tokens at the check layer, then at each re-pick layer
    keep those whose fresh K (or V) still deviates most from the cache there; CacheBlend's budget."""
    return hkvd_prefill(adapter, inp, cfg, repick_schedule(cfg, adapter.layout.n_layers), clock, reader)
