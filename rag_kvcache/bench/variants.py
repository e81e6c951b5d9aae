"""What a benchmark run compares: its settings, and the variants (a method at given parameters, on the
index's caches or on caches made another way) parsed from `--methods` and planned from a sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import CHUNK_PREFILLS, Config, FusionConfig, at_least
from ..engine.methods import METHODS
from ..store.codecs import CODECS
from .datasets import EVIDENCE_PLACES
from .prompts import NATIVE, PROMPT_STYLES
from .report import label

REFERENCE = "full"
DEFAULT_METHODS = ("full", "prefix", "reuse", "cacheblend", "epic", "epic_match")
ALL_METHODS = "all"  # --methods all: every registered method at its defaults
DEFAULT_BASELINE = "cacheblend"
NOISE_FLOOR = {"kv": "bfloat16"}  # the params of the noise-floor row: full with its K/V rounded to bfloat16
PARAM_FIELDS = {"r": "ratio", "k": "epic_k"}
PARAM_TYPES = {"r": float, "k": int}
METHOD_PARAMS = {  # the first is always shown
    "cacheblend": ("r",),
    "epic": ("k",),
    "epic_match": ("k",),
}


@dataclass(frozen=True)
class Variant:
    """One method at one parameter setting, e.g. `cacheblend` with r=0.05, on the chunk caches of the
    run's index or, with `caches`, of an index over the same corpus whose caches are made another way:
    computed with that `chunk_prefill` or stored with that codec (written `method@caches` in a methods
    list, e.g. `reuse@neighbours`, `cacheblend@none`)."""

    method: str
    params: tuple[tuple[str, float | int], ...] = ()
    caches: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown fusion method {self.method!r}; available: {', '.join(METHODS)}")
        unknown = [key for key, _ in self.params if key not in PARAM_FIELDS]
        if unknown:
            raise ValueError(f"unknown variant parameters {unknown} for {self.method!r}; known: {sorted(PARAM_FIELDS)}")
        if self.caches is not None and self.caches not in (*CHUNK_PREFILLS, *CODECS):
            raise ValueError(
                f"unknown chunk caches {self.caches!r} in {self.method}@{self.caches}; known: "
                f"{', '.join(CHUNK_PREFILLS)} (chunk_prefill), {', '.join(CODECS)} (codec)"
            )

    @property
    def label(self) -> str:
        return label({"method": self.method, "params": dict(self.params), "caches": self.caches})

    def fusion(self, base: FusionConfig) -> FusionConfig:
        return replace(base, method=self.method, **{PARAM_FIELDS[key]: value for key, value in self.params})


@dataclass(frozen=True)
class BenchSettings:
    """What is run and how it is timed (model, chunking, top-k and decoding live in `Config`)."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    sweep: bool = False
    sweep_ratios: tuple[float, ...] = (0.05, 0.1, 0.15, 0.25, 0.5)
    sweep_epic_ks: tuple[int, ...] = (0, 4, 16, 32)
    baseline: str = DEFAULT_BASELINE  # the method every variant's fidelity is compared with, pairwise
    warmup: int = 1
    threads: int = 2
    resume: bool = False  # keep the questions an interrupted run in the same --out finished
    prompt_style: str = NATIVE  # the prompt layout every question is asked in (`bench.prompts`)
    evidence: str = EVIDENCE_PLACES[0]  # where a planted fact's chunk goes among the retrieved (`EVIDENCE_PLACES`)

    def __post_init__(self) -> None:
        if self.evidence not in EVIDENCE_PLACES:
            raise ValueError(f"unknown evidence place {self.evidence!r}; places: {', '.join(EVIDENCE_PLACES)}")
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"unknown prompt style {self.prompt_style!r}; styles: {', '.join(PROMPT_STYLES)}")
        if REFERENCE not in self.methods:
            raise ValueError(f"methods must include {REFERENCE!r}, the reference of every metric; got {self.methods}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must not repeat, got {self.methods}")
        if self.baseline not in self.methods:
            raise ValueError(
                f"baseline {self.baseline!r} is not among the methods {self.methods}: add it or pick another baseline"
            )
        at_least(self, warmup=0, threads=1)


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated method names, or "all": every registered method."""
    if text.strip() == ALL_METHODS:
        return tuple(METHODS)
    return tuple(m.strip() for m in text.split(",") if m.strip())


def parse_variant(spec: str, base: FusionConfig, config: Config, value: float | int | None = None) -> Variant:
    """The variant `spec` names, written `METHOD[:PARAM=VALUE][@CACHES]`: `epic:k=24` sets one of the method's
    parameters (`METHOD_PARAMS`; its first, shown in every label, is otherwise `value`, else `base`'s), e.g.
    `cacheblend:r=0.3` CacheBlend at ratio 0.3; `@caches` runs it on the caches of
    an index built with that `chunk_prefill` or codec (`config`'s own are the default and are not written)."""
    spec, _, caches = spec.partition("@")
    method, _, setting = spec.partition(":")
    base = base.for_chunks(config.index.chunk_tokens)  # the EPIC heads it runs with, shown in its label
    caches = None if caches in ("", config.index.chunk_prefill, config.index.codec) else caches
    keys = METHOD_PARAMS.get(method, ())
    given: dict[str, float | int] = {}
    if setting:
        key, _, text = setting.partition("=")
        if key not in keys:
            named = " or ".join(f"{k}=VALUE" for k in keys)
            raise ValueError(
                f"{spec!r}: {method} takes "
                + ("no parameter" if not keys else f"only {named}" if len(keys) == 1 else f"one of {named}")
            )
        kind = PARAM_TYPES[key]
        try:
            given[key] = kind(text)
        except ValueError:
            raise ValueError(
                f"{spec!r}: {key} must be a{'n int' if kind is int else ' number'}, got {text!r}"
            ) from None
    if not keys:
        return Variant(method, caches=caches)
    shown = given.get(keys[0], getattr(base, PARAM_FIELDS[keys[0]]) if value is None else value)
    return Variant(method, ((keys[0], shown), *((k, v) for k, v in given.items() if k != keys[0])), caches)


def plan(settings: BenchSettings, base: FusionConfig, config: Config) -> list[Variant]:
    """The variants to run (`parse_variant`): each method as written, then the sweep points not already there."""
    variants = [parse_variant(spec, base, config) for spec in settings.methods]
    if settings.sweep:
        sweep = [("cacheblend", v) for v in settings.sweep_ratios] + [("epic", v) for v in settings.sweep_epic_ks]
        variants += [parse_variant(method, base, config, value) for method, value in sweep]
    return list(dict.fromkeys(variants))


# ---- indexing ---------------------------------------------------------------------------------------


def made_with(config: Config, caches: str) -> Config:
    """`config` with its chunk caches made as `caches` names: a `chunk_prefill` or a storage codec."""
    return config.with_index(**{"codec" if caches in CODECS else "chunk_prefill": caches})


# ---- per-question measurement -------------------------------------------------------------------------


def rotated(variants: Sequence[Variant], i: int) -> list[Variant]:
    """`variants` rotated by `i` places: over len(variants) questions each runs once in every slot."""
    shift = i % len(variants)
    return [*variants[shift:], *variants[:shift]]
