"""How a question is answered unless its request says otherwise, never recorded by an index: `QueryConfig`
(chunks retrieved and their order in the prompt) with its `FusionConfig` (how the chunks' caches are fused) and
its `GenerationConfig` (decoding). A request's own options are put over these (`GenerationConfig.with_options`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from ..errors import ConfigError
from .defaults import (
    BUILTIN_METHODS,
    CHUNK_ORDERS,
    EPIC_SHARE,
    FLOAT32_TINY,
    GREEDY_BELOW,
    ChunkOrder,
    Deviation,
    at_least,
    one_of,
    setting,
)

T = TypeVar("T")


@dataclass(frozen=True)
class FusionConfig:
    """How retrieved chunk caches are fused into one prompt cache.

    `ratio`, `check_layer`, `deviation` are CacheBlend's knobs (paper defaults: 15%, layer 1, K);
    `filter_steps` > 1 enables the paper's gradual filtering (§4.3): the kept fraction shrinks
    linearly from `min(1, 2 * ratio)` at the check layer to `ratio` over that many layers.
    `epic_k` is EPIC LegoLink's number of recomputed leading tokens per chunk (paper default 16); unset, an
    `EPIC_SHARE`-th of the index's chunk size (`for_chunks`, before fusing): 16 at 128-token chunks, 64 at 512.
    `ratio="auto"` asks the loading controller; `store.controller.resolve_ratio` turns it into a
    number before fusing.
    """

    method: str = setting(
        "epic_match", f"Fusion method: a name registered in rag_kvcache.METHODS (built in: {BUILTIN_METHODS})."
    )
    ratio: float | Literal["auto"] = setting(
        0.15,
        "CacheBlend recompute ratio in [0, 1], or 'auto': the loading controller's choice "
        "(needs `rag-kvcache calibrate`).",
    )
    check_layer: int = setting(1, "CacheBlend check layer.")
    filter_steps: int = setting(
        1, "CacheBlend gradual filtering: narrow the selection to the ratio over this many layers."
    )
    deviation: Deviation = setting("k", "CacheBlend: select the tokens whose K (or V) deviates most from the cache.")
    epic_k: int | None = setting(
        None,
        "EPIC: recomputed leading tokens per chunk; unset: an eighth of the index's chunk size (16 at 128-token "
        "chunks, 64 at 512), the same share of every chunk at any chunk size.",
    )
    match_words: int = setting(
        3, "epic_match: a sentence echoes the question when it shares this many distinct words with it."
    )
    repick_layers: tuple[int, ...] = setting(
        (4, 10),
        "cacheblend_repick: layers after the check layer where the HKVD tokens are picked again, fewer each time.",
    )
    repick_decay: float = setting(
        0.5, "cacheblend_repick: each re-pick keeps this fraction of the tokens kept before it."
    )
    template_text: bool = setting(
        False,
        "Read a prompt template's recurring text after the chunks (learned from the prompts) from a cache, as an "
        "inexact chunk's: faster, at a measured fidelity cost (CacheBlend TF KL +15% in LlamaIndex's layout); off: it "
        "is computed.",
    )

    def __post_init__(self) -> None:
        if self.ratio != "auto" and (isinstance(self.ratio, str) or not 0.0 <= self.ratio <= 1.0):
            raise ConfigError(f"ratio must be in [0, 1] or 'auto', got {self.ratio!r}")
        at_least(self, check_layer=0, filter_steps=1, epic_k=0, match_words=1)
        one_of(self, deviation=("k", "v"))
        if not 0.0 < self.repick_decay <= 1.0:
            raise ConfigError(f"repick_decay must be in (0, 1], got {self.repick_decay!r}")

    def check_model(self, n_layers: int, chunk_tokens: int) -> FusionConfig:
        """This config, if its parameters fit a model of `n_layers` layers and an index of `chunk_tokens`-token
        chunks (`check_layer` and the layers `filter_steps` reach below `n_layers`, `epic_k` at most a chunk);
        else a ConfigError naming the parameter and its value (they were once accepted silently)."""
        if self.check_layer >= n_layers:
            raise ConfigError(
                f"check_layer must be below the model's {n_layers} layers (0..{n_layers - 1}), got {self.check_layer!r}"
            )
        if self.check_layer + self.filter_steps > n_layers:
            raise ConfigError(
                f"filter_steps must be at most {n_layers - self.check_layer} (the model's {n_layers} layers from "
                f"check_layer {self.check_layer} on), got {self.filter_steps!r}"
            )
        if self.epic_k is not None and self.epic_k > chunk_tokens:
            raise ConfigError(
                f"epic_k must be at most the index's chunk size ({chunk_tokens} tokens), got {self.epic_k!r}"
            )
        return self

    def for_chunks(self, chunk_tokens: int) -> FusionConfig:
        """This config with `epic_k` set for an index of `chunk_tokens`-token chunks: as given, else an
        `EPIC_SHARE`-th of the chunk size (EPIC's 16 heads are that share of a 128-token chunk)."""
        return self if self.epic_k is not None else replace(self, epic_k=max(1, chunk_tokens // EPIC_SHARE))


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding after the fused prefill: sampled at a `temperature` of `GREEDY_BELOW` or more, greedy below
    (logits divided by a smaller one overflow float32; vLLM draws the same line)."""

    max_new_tokens: int = setting(64, "Most tokens to generate.")
    temperature: float = setting(0.0, "Sampling temperature; 0 (or below 1e-5) decodes greedily, above samples.")
    top_p: float = setting(0.9, "Nucleus sampling: sample from the smallest set of tokens holding this probability.")
    seed: int | None = setting(None, "Seed for sampling (none: a fresh random seed).")
    stop: tuple[str, ...] = setting((), "Stop string: generation ends before it (repeatable).")
    json_schema: str | None = setting(
        None,
        "A JSON Schema (as JSON text): the answer is decoded constrained to JSON that matches it "
        "(needs rag-kvcache[structured]).",
    )
    draft_tokens: int = setting(
        2,
        "Prompt lookup (speculative decoding): a step decoding one answer alone also feeds up to this many tokens "
        "that followed the answer's last tokens where they occur earlier in the prompt or answer, and keeps those "
        "the model would have decoded itself, so an answer that quotes its documents takes fewer steps. Greedy, "
        "unconstrained decoding only (else ignored): the answer is the one decoding a token a step gives. 0: off.",
    )

    def __post_init__(self) -> None:
        at_least(self, max_new_tokens=1, draft_tokens=0, temperature=0)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < FLOAT32_TINY:
            raise ConfigError(
                f"top_p must be at least {FLOAT32_TINY:.3g} (probabilities are float32; a smaller one rounds to 0), "
                f"got {self.top_p!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def with_options(
        self,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        json_schema: str | None = None,
    ) -> GenerationConfig:
        """These settings with a caller's per-request options (a framework's `max_tokens`, `temperature`,
        ...) put over them; None keeps the setting."""
        given = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": None if stop is None else tuple(stop),
            "json_schema": json_schema,
        }
        return replace(self, **{name: value for name, value in given.items() if value is not None})


@dataclass(frozen=True)
class QueryConfig:
    """How a question is answered unless its request says otherwise: never recorded by an index."""

    top_k: int = setting(6, "Chunks retrieved per question.")
    chunk_order: ChunkOrder = setting(
        "best_last",
        "Where the retrieved chunks go in the prompt: best_last ends with the best-ranked one, next to the question "
        "(the fused prompt keeps more of a full prefill's answers there: docs/methods.md), best_first in retrieval's "
        "order. Chunks a request names keep the order it names them in.",
    )
    fusion: FusionConfig = field(default_factory=FusionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self) -> None:
        at_least(self, top_k=1)
        one_of(self, chunk_order=CHUNK_ORDERS)

    def in_prompt_order(self, ranked: Sequence[T]) -> list[T]:
        """Retrieved chunks, best first, in the order the prompt lays them out (`chunk_order`)."""
        return list(reversed(ranked)) if self.chunk_order == "best_last" else list(ranked)
