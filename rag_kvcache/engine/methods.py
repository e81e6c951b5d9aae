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
- `epic_evidence` EPIC, and the `evidence_sentences` sentences of inexact chunks closest in meaning to the
               question (the index's embedder): the evidence, found when the question uses other words.
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
from .fusion import FusionInput, FusionModel, FusionResult, LayerReader, selective_prefill
from .graphs import Pick
from .model import ModelAdapter
from .ops import kv_deviation, left_deviation, relative_deviation, select_tokens
from .profiling import StageClock
from .sentences import closest_sentences, echo_sentences, sentence_ids

MethodFn = Callable[[FusionModel, FusionInput, FusionConfig, "StageClock | None", "LayerReader | None"], FusionResult]


@dataclass(frozen=True)
class Method:
    """A registered fusion method; `reads_cache` is False for methods that compute every token, `exact`
    True for those whose K/V equal a full prefill's over the caches they read (to float rounding),
    `reads_relevance` True for those that read `FusionInput.relevance`."""

    name: str
    fn: MethodFn
    reads_cache: bool = True
    exact: bool = False
    reads_relevance: bool = False

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


def register(
    name: str, reads_cache: bool = True, exact: bool = False, reads_relevance: bool = False
) -> Callable[[MethodFn], MethodFn]:
    """Register a fusion method under `name` (replacing any method of that name)."""

    def deco(fn: MethodFn) -> MethodFn:
        METHODS[name] = Method(name, fn, reads_cache, exact, reads_relevance)
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
    that each attends to the earlier ones as in a full prefill and the question's subject binds to its own.
    With `drift_limit`, its drift estimate is the K deviation of the chunk tokens it recomputes (fresh against
    their caches: `ops.relative_deviation`), averaged over `drift_layers` layers from the check layer; a question
    over the limit is answered as `prefix` (exact), after the fused forward that estimated it."""
    active = epic_match_tokens(adapter, inp, cfg).nonzero()[:, 0]  # [A]
    if cfg.drift_limit is None:
        return selective_prefill(adapter, inp, active, clock=clock, reader=reader)
    layers = range(cfg.check_layer, cfg.check_layer + cfg.drift_layers)
    if layers[-1] >= adapter.layout.n_layers:
        raise ValueError(
            f"epic_match's drift estimate reads layers {layers[0]}..{layers[-1]}, beyond the model's "
            f"{adapter.layout.n_layers} layers (check_layer {cfg.check_layer}, drift_layers {cfg.drift_layers})"
        )
    drift: list[torch.Tensor] = []

    def record(layer: int, now: torch.Tensor, fresh_kv, layer_cache) -> None:  # `now`: the active set, unchanged
        if layer in layers:
            drift.append(relative_deviation(fresh_kv[0], layer_cache[0][:, now], inp.reusable[now]))  # []
        return None  # the tokens stay epic_match's

    result = selective_prefill(adapter, inp, active, record, clock=clock, reader=reader, settled=layers[-1] + 1)
    estimate = float(torch.stack(drift).mean())  # the one sync, after the forward
    if estimate > cfg.drift_limit:
        result = prefix(adapter, inp, cfg, clock, None)  # the caches read again, in this thread
        result.bounded = True
    result.drift = estimate
    return result


def epic_match_tokens(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig) -> torch.Tensor:
    """The tokens `epic_match` computes [N]: the uncached ones, the chunk heads and the echoing sentences."""
    chunks = inp.token_mask(lambda p: p.kv is not None and p.start > 0)  # [N], the cached head at 0 is no chunk
    question = inp.token_mask(lambda p: p is inp.parts[-1])  # [N]
    echoes = echo_sentences(inp.ids, adapter.lexicon, inp.segment_of, chunks, question, cfg.match_words)  # [N]
    return inp.fresh | chunk_heads(inp, cfg.epic_k) | (echoes & inp.reusable)  # [N]


@register("epic_evidence", reads_relevance=True)
def epic_evidence(adapter: FusionModel, inp: FusionInput, cfg: FusionConfig, clock=None, reader=None) -> FusionResult:
    """EPIC, and the `evidence_sentences` sentences of inexact chunks closest in meaning to the question
    (`inp.relevance`, from the index's embedder), recomputed so that each attends to the chunks before it as
    in a full prefill: the evidence `epic_match` finds by the question's words, found when it uses others."""
    if inp.relevance is None:
        raise ValueError(
            "epic_evidence reads each sentence's relevance to the question (FusionInput.relevance), "
            "which this prompt was laid out without"
        )
    sentence = sentence_ids(adapter.lexicon.sentence_end[inp.ids], inp.segment_of)  # [N]
    relevant = inp.relevance.masked_fill(~inp.reusable, -math.inf)  # [N]
    evidence = closest_sentences(relevant, sentence, cfg.evidence_sentences)  # [N]
    active = inp.fresh | chunk_heads(inp, cfg.epic_k) | evidence  # [N]
    return selective_prefill(adapter, inp, active.nonzero()[:, 0], clock=clock, reader=reader)


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
    the whole forward is one captured step (`graphs.Pick`: the counts kept are known before it starts),
    unless `cfg.drift_limit` must be read within it or a pick is at the last layer."""
    fresh, reusable = inp.fresh, inp.reusable  # [N]
    n_fresh, n_reusable = inp.count(lambda p: p.fresh), inp.count(lambda p: p.reusable)  # on the host: no sync
    which = 0 if cfg.deviation == "k" else 1
    initial = (fresh | reusable).nonzero()[:, 0]  # [A]
    keeps, n = {}, n_fresh + n_reusable  # layer -> tokens kept from it; the active set only shrinks
    for layer in sorted(schedule):
        keeps[layer] = n = min(n, n_fresh + round(schedule[layer] * n_reusable))
    if adapter.graphs is not None and cfg.drift_limit is None and max(schedule) < adapter.layout.n_layers - 1:
        picks = tuple(Pick(layer, keep) for layer, keep in keeps.items())
        return selective_prefill(adapter, inp, initial, clock=clock, reader=reader, picks=picks, which=which)
    check = min(schedule)
    drift: list[torch.Tensor] = []  # the check layer's estimate, read once the forward is done
    bounded = False

    def refine(layer: int, active: torch.Tensor, fresh_kv, layer_cache) -> torch.Tensor | None:
        nonlocal bounded
        if layer not in schedule or bounded:
            return None
        forced = fresh[active]  # [A]
        cached = layer_cache[which][:, active]  # [H_kv, A, D]
        score = kv_deviation(fresh_kv[which], cached)  # [A]
        score.masked_fill_(forced, math.inf)  # every uncached token is active, and kept
        keep = select_tokens(score, keeps[layer])  # [A']
        if layer == check:
            reusable_here = ~forced  # [A]
            left = reusable_here.clone()  # [A]
            left[keep] = False
            drift.append(left_deviation(score, cached, reusable_here, left))
            if cfg.drift_limit is not None and drift[0].item() > cfg.drift_limit:  # the one sync, when bounded
                bounded = True
                return None  # every active token goes on: full prefill's K/V from here
        return keep

    result = selective_prefill(adapter, inp, initial, refine, clock=clock, reader=reader, settled=max(schedule) + 1)
    result.drift = float(drift[0]) if drift else None
    result.bounded = bounded
    return result


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
