"""The benchmark harness behind `rag-kvcache bench`: one index over every passage of a QA set, then
every fusion method (and sweep point) on the same retrieved chunks of every question.

Protocol, so that the numbers hold up:
- Indexing (chunking, embedding, KV precompute) is timed on its own and reported as tokens/s and as
  a fraction of the model's plain forward throughput; it is never part of a TTFT.
- Per question, retrieval runs once (timed separately) and every variant answers over the same
  chunks in the same order. TTFT is `Answer.ttft_s`: question in to first token out, cache loading
  and fusion included.
- The variant order rotates from question to question, so machine drift hits every variant alike;
  the first `warmup` questions are run once untimed before measuring.
- Quality is fidelity to `full`, teacher-forced: `full`'s greedy answer is forced through every
  variant's fused cache (the same cache the timed answer used) and scored position by position (KL
  from full's distributions, top-1 agreement, log-probability change, first-token KL); each mean has
  a bootstrap CI over questions and a paired difference from a baseline variant. `full` with its K/V
  rounded to bfloat16 is scored alike: the noise floor. On exact-string datasets (planted facts),
  `planted_accuracy` counts the answers holding the fact among the questions `full` gets right, and
  `planted_distractor` those answered instead with another question's fact that the prompt also holds
  (a retrieved chunk with a fact of the same kind: the binding of value to subject lost). F1
  against the gold answers and against full's answer are kept as secondary columns. Speedup is the
  median over questions of the per-question TTFT ratio to `full`.
- Records are appended to `records.jsonl` as each question finishes, and an interrupted run still
  writes the report of the questions it finished. `resume` goes on from `records.jsonl` after a run
  was killed outright, provided `plan.json` (written before the first question) shows the same model,
  settings, variants and machine; a question is kept only when every variant of it was recorded.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import CHUNK_PREFILLS, Config, FusionConfig, GenerationConfig
from ..engine.generation import Decoder, sample_token, teacher_forced_logits
from ..engine.methods import METHODS, filter_schedule
from ..engine.model import ModelAdapter
from ..engine.prompt import Segment
from ..generator import Answer, Fused, FusedGenerator
from ..index import KVIndex
from ..retrieval.chunk_index import Hit
from ..store.codecs import CODECS
from ..store.controller import machine_id, resolve_ratio, time_prefill
from .datasets import QAExample
from .metrics import bootstrap_ci, contains_answer, max_f1, median_p90, median_ratio, rouge_l, teacher_forced
from .prompts import NATIVE, PROMPT_STYLES, style_messages
from .report import atomic_write, label, write_report

log = logging.getLogger(__name__)

REFERENCE = "full"
DEFAULT_METHODS = ("full", "prefix", "reuse", "cacheblend", "epic")
ALL_METHODS = "all"  # --methods all: every registered method at its defaults
DEFAULT_BASELINE = "cacheblend"
FIDELITY_KEYS = ("tf_kl", "tf_top1", "tf_logp_delta", "first_token_kl")
NOISE_FLOOR = {"kv": "bfloat16"}  # the params of the noise-floor row: full with its K/V rounded to bfloat16
# Short parameter names used in labels ("cacheblend r=0.15") -> FusionConfig fields.
PARAM_FIELDS = {"r": "ratio", "k": "epic_k", "drift": "drift_limit"}
PARAM_TYPES = {"r": float, "k": int, "drift": float}
METHOD_PARAMS = {"cacheblend": ("r", "drift"), "epic": ("k",), "epic_match": ("k",)}  # the first is always shown
OTHER_STAGE = "other"  # TTFT not inside a prefill stage: decoder setup and first-token sampling


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
            raise ValueError(f"unknown chunk caches {self.caches!r} in {self.method}@{self.caches}; known: "
                             f"{', '.join(CHUNK_PREFILLS)} (chunk_prefill), {', '.join(CODECS)} (codec)")

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

    def __post_init__(self) -> None:
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"unknown prompt style {self.prompt_style!r}; styles: {', '.join(PROMPT_STYLES)}")
        if REFERENCE not in self.methods:
            raise ValueError(f"methods must include {REFERENCE!r}, the reference of every metric; got {self.methods}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must not repeat, got {self.methods}")
        if self.baseline not in self.methods:
            raise ValueError(f"baseline {self.baseline!r} is not among the methods {self.methods}: add it or pick "
                             "another baseline")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated method names, or "all": every registered method."""
    if text.strip() == ALL_METHODS:
        return tuple(METHODS)
    return tuple(m.strip() for m in text.split(",") if m.strip())


def parse_variant(spec: str, base: FusionConfig, config: Config, value: float | int | None = None) -> Variant:
    """The variant `spec` names, written `METHOD[:PARAM=VALUE][@CACHES]`: `epic:k=24` sets one of the method's
    parameters (`METHOD_PARAMS`; its first, shown in every label, is otherwise `value`, else `base`'s), e.g.
    `cacheblend:drift=0.3` CacheBlend at the base ratio with a drift limit; `@caches` runs it on the caches of
    an index built with that `chunk_prefill` or codec (`config`'s own are the default and are not written)."""
    spec, _, caches = spec.partition("@")
    method, _, setting = spec.partition(":")
    caches = None if caches in ("", config.chunk_prefill, config.storage.codec) else caches
    keys = METHOD_PARAMS.get(method, ())
    given: dict[str, float | int] = {}
    if setting:
        key, _, text = setting.partition("=")
        if key not in keys:
            named = " or ".join(f"{k}=VALUE" for k in keys)
            raise ValueError(f"{spec!r}: {method} takes " + ("no parameter" if not keys else
                                                               f"only {named}" if len(keys) == 1 else f"one of {named}"))
        kind = PARAM_TYPES[key]
        try:
            given[key] = kind(text)
        except ValueError:
            raise ValueError(f"{spec!r}: {key} must be a{'n int' if kind is int else ' number'}, got {text!r}") from None
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
@dataclass(frozen=True)
class IndexingStats:
    passages: int
    chunks: int
    tokens: int  # chunk tokens prefilled by this run (0 when the index was already complete)
    seconds: float  # chunking + embedding + KV precompute
    forward_tokens_per_s: float  # the model's plain forward over one 512-token input

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        rate = self.tokens_per_s
        return {
            "passages": self.passages, "chunks": self.chunks, "tokens": self.tokens, "seconds": self.seconds,
            "tokens_per_s": rate, "forward_tokens_per_s": self.forward_tokens_per_s,
            "fraction_of_forward": None if rate is None else rate / self.forward_tokens_per_s,
        }


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:48] or "untitled"


def write_corpus(examples: Sequence[QAExample], docs_dir: Path) -> int:
    """Write every distinct passage of `examples` as `<i>-<slug>.txt` ("title\\ntext"); returns how many."""
    passages = dict.fromkeys(doc for ex in examples for doc in ex.documents)
    docs_dir.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(passages):
        text = f"{doc.title}\n{doc.text}" if doc.title else doc.text
        (docs_dir / f"{i:05d}-{_slug(doc.title)}.txt").write_text(text, encoding="utf-8")
    return len(passages)


def forward_throughput(adapter: ModelAdapter, n_tokens: int = 512, repeats: int = 3) -> float:
    """Tokens/s of a plain forward over `n_tokens` ids: median of `repeats` after a warm-up."""
    ids = torch.randint(0, adapter.model.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    adapter.prefill(ids)
    return n_tokens / float(np.median([time_prefill(adapter, ids) for _ in range(repeats)]))


def build_index(
    examples: Sequence[QAExample], work_dir: Path, config: Config, adapter: ModelAdapter, progress: bool,
    name: str = "index",
) -> tuple[KVIndex, IndexingStats]:
    """Index every passage of `examples` into `work_dir / name` (incremental if already there) and time it."""
    n_passages = write_corpus(examples, work_dir / "docs")
    index = KVIndex.create(work_dir / name, config, adapter)
    t0 = time.perf_counter()
    report = index.update(work_dir / "docs", progress=progress)
    seconds = time.perf_counter() - t0
    if report.removed or report.changed:
        raise ValueError(f"{work_dir / name} holds another corpus ({len(report.removed)} files removed, "
                         f"{len(report.changed)} changed): use a new --out")
    stats = IndexingStats(
        passages=n_passages, chunks=len(index.chunks), tokens=sum(len(c.token_ids) for c in report.new_chunks),
        seconds=seconds, forward_tokens_per_s=forward_throughput(adapter),
    )
    if not stats.tokens:
        log.info("index %s was already complete: indexing throughput not measured", work_dir / "index")
    return index, stats


def made_with(config: Config, caches: str) -> Config:
    """`config` with its chunk caches made as `caches` names: a `chunk_prefill` or a storage codec."""
    if caches in CODECS:
        return config.with_storage(codec=caches)
    return replace(config, chunk_prefill=caches)


# ---- per-question measurement -------------------------------------------------------------------------
def rotated(variants: Sequence[Variant], i: int) -> list[Variant]:
    """`variants` rotated by `i` places: over len(variants) questions each runs once in every slot."""
    shift = i % len(variants)
    return [*variants[shift:], *variants[:shift]]


def _stages(answer: Answer) -> dict[str, float]:
    return {**answer.stages, OTHER_STAGE: max(0.0, answer.ttft_s - sum(answer.stages.values()))}


def _record(
    example: QAExample, variant: Variant, slot: int, answer: Answer, reference: Answer, retrieval_s: float,
    fidelity: Mapping[str, float | None], evidence: int | None, distractors: Sequence[str],
) -> dict[str, Any]:
    summarisation = example.task == "summarization"
    hit = contains_answer(answer.answer, example.answers) if example.task == "exact" else None
    return {
        "id": example.id, "question": example.question, "gold": list(example.answers),
        "method": variant.method, "params": dict(variant.params), "caches": variant.caches, "label": variant.label, "slot": slot,
        "answer": answer.answer, "ttft_s": answer.ttft_s, "retrieval_s": retrieval_s,
        "prompt_tokens": answer.prompt_tokens, "recomputed_tokens": answer.recomputed_tokens,
        "recompute_fraction": answer.recomputed_tokens / answer.prompt_tokens,
        "compute_fraction": answer.compute_fraction, "generation_s": answer.generation_s,
        "generated_tokens": answer.generated_tokens, "cache_misses": answer.cache_misses,
        "drift": answer.drift, "bounded": answer.bounded,
        "chunks": [c.id for c in answer.chunks], "stages": _stages(answer),
        "f1_gold": max_f1(answer.answer, example.answers),
        "f1_vs_full": max_f1(answer.answer, [reference.answer]),
        "rouge_l_gold": max(rouge_l(answer.answer, a) for a in example.answers) if summarisation else None,
        "exact_hit": hit,
        "distractor_hit": None if hit is None else (
            not hit and bool(distractors) and contains_answer(answer.answer, distractors)),
        "evidence_retrieved_rank": evidence, "evidence_rank": example.evidence_rank if evidence is not None else None,
        **fidelity,
    }


def place_evidence(hits: Sequence[Hit], example: QAExample) -> tuple[list[Hit], int | None]:
    """For a planted fact (`example.evidence_rank` set): `hits` with the first chunk holding the answer
    moved to that rank, and the rank retrieval gave it (None, order kept, when it was not retrieved)."""
    if example.evidence_rank is None:
        return list(hits), None
    if example.evidence_rank >= len(hits):
        raise ValueError(f"{example.id!r}: evidence_rank {example.evidence_rank} is beyond the {len(hits)} retrieved "
                         "chunks: plant the facts for this top-k")
    found = next((i for i, h in enumerate(hits) if contains_answer(h.chunk.text, example.answers)), None)
    if found is None:
        log.warning("%s: the chunk holding %r was not retrieved", example.id, example.answers[0])
        return list(hits), None
    rest = [h for i, h in enumerate(hits) if i != found]
    return [*rest[: example.evidence_rank], hits[found], *rest[example.evidence_rank :]], found


def distractors_in(hits: Sequence[Hit], example: QAExample, facts: frozenset[str]) -> list[str]:
    """The exact answers of other questions (`facts`) that a retrieved chunk holds: facts a fused answer
    may give instead of `example`'s own."""
    others = facts - set(example.answers)
    return sorted(a for a in others if any(contains_answer(h.chunk.text, [a]) for h in hits))


def greedy_answer_ids(adapter: ModelAdapter, fused: Fused, generation: GenerationConfig) -> list[int]:
    """The token ids of the greedy answer decoded from `fused` (what `ask` answers with, as ids)."""
    greedy = replace(generation, temperature=0.0)
    result = fused.result
    steps = Decoder(adapter, greedy).steps(result.keys, result.values, result.logits, sample_token(result.logits, greedy, None))
    return [step.token_id for step in steps if step.token_id is not None]


def bfloat16_rounded(fused: Fused, adapter: ModelAdapter, last_token: int) -> tuple[list, list, torch.Tensor]:
    """The noise floor: `fused`'s K/V rounded to bfloat16 and back, and the last prompt token's logits
    recomputed over the rounded cache of the tokens before it [V]."""
    keys = [k.to(torch.bfloat16).to(k.dtype) for k in fused.result.keys]  # L x [H_kv, N, D]
    values = [v.to(torch.bfloat16).to(v.dtype) for v in fused.result.values]  # L x [H_kv, N, D]
    before = adapter.make_cache([k[:, :-1] for k in keys], [v[:, :-1] for v in values])
    first = adapter.decode([last_token], before, fused.prompt_tokens - 1)[-1]  # [V]
    return keys, values, first


def fidelity(
    generators: Mapping[str | None, FusedGenerator], segments: Sequence[Segment],
    variants: Sequence[Variant], config: Config,
) -> tuple[dict[Variant, dict[str, float | None]], dict[str, float | None]]:
    """Teacher-forced scores of every variant, and of the bfloat16 noise floor, against `full`: full's
    greedy answer forced through each variant's fused cache (`fuse` is deterministic: the cache the
    timed answer used). All None when full answers with no token at all."""
    generator = generators[None]
    adapter = generator.adapter
    reference = generator.fuse(segments, Variant(REFERENCE).fusion(config.fusion))
    answer_ids = greedy_answer_ids(adapter, reference, config.generation)
    if not answer_ids:
        log.warning("full answered with no token: no teacher-forced scores for this question")
        return {v: dict.fromkeys(FIDELITY_KEYS) for v in variants}, dict.fromkeys(FIDELITY_KEYS)

    def forced(keys: list, values: list, first: torch.Tensor) -> np.ndarray:
        return teacher_forced_logits(adapter, keys, values, first, answer_ids).cpu().numpy()  # [T, V]

    ref = reference.result
    ref_logits = forced(ref.keys, ref.values, ref.logits)  # [T, V]
    scores = {}
    for v in variants:
        fused = reference if v == Variant(REFERENCE) else generators[v.caches].fuse(segments, v.fusion(config.fusion))
        scores[v] = teacher_forced(ref_logits, forced(fused.result.keys, fused.result.values, fused.result.logits), answer_ids)
    floor = teacher_forced(ref_logits, forced(*bfloat16_rounded(reference, adapter, segments[-1].ids[-1])), answer_ids)
    return scores, floor


def run_question(
    generators: Mapping[str | None, FusedGenerator], example: QAExample, variants: Sequence[Variant],
    slot_shift: int, prompt_style: str = NATIVE, facts: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Retrieve once, answer with every variant (rotated by `slot_shift`) on its caches' index
    (`generators[variant.caches]`; None: the run's index) in the `prompt_style` layout, and score
    against `full` on the same prompt. `facts`: the run's exact answers; those of other questions that
    a retrieved chunk holds are this question's distractors."""
    generator = generators[None]
    config = generator.index.config
    t0 = time.perf_counter()
    hits: list[Hit] = generator.index.search(example.question, config.top_k)
    retrieval_s = time.perf_counter() - t0
    hits, evidence = place_evidence(hits, example)
    distractors = distractors_in(hits, example, facts)
    order = rotated(variants, slot_shift)
    if prompt_style == NATIVE:
        answers = {
            v: generators[v.caches].ask(example.question, hits, fusion=v.fusion(config.fusion), generation=config.generation)
            for v in order
        }
        fmt = generator.index.format
        segments = fmt.segments([h.chunk.token_ids for h in hits], fmt.question_ids(generator.adapter.tokenizer, example.question))
    else:  # the prompt a pipeline of this style sends, the chunks found in it (matching timed in the TTFT)
        prompt = style_messages(prompt_style, [h.chunk.text for h in hits], example.question)
        answers = {
            v: generators[v.caches].complete(prompt, fusion=v.fusion(config.fusion), generation=config.generation)
            for v in order
        }
        segments = generator.prompt_segments(prompt)
    scores, floor = fidelity(generators, segments, variants, config)
    reference = answers[Variant(REFERENCE)]
    records = [
        _record(example, v, order.index(v), answers[v], reference, retrieval_s, scores[v], evidence, distractors)
        for v in variants
    ]
    records[variants.index(Variant(REFERENCE))]["noise_floor"] = floor
    matched = chunk_tokens_matched(segments, hits)
    for r in records:
        r |= {"chunks": [h.chunk.id for h in hits], "chunk_tokens_matched": matched}
    return records


def chunk_tokens_matched(segments: Sequence[Segment], hits: Sequence[Hit]) -> float:
    """The fraction of the retrieved chunks' tokens that the prompt's segments read from a chunk cache
    (1.0 in the native layout; less where a prompt's text around a chunk re-tokenises its edges). A head
    or a template's text read from cache is not chunk text."""
    matched = sum(len(s.ids) for s in segments if s.cacheable and s.label.startswith("chunk"))
    return matched / sum(len(h.chunk.token_ids) for h in hits)


# ---- summary ------------------------------------------------------------------------------------------
def _mean(values: Sequence[float | bool | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _stage_medians(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    names = dict.fromkeys(name for r in records for name in r["stages"])
    return {name: float(np.median([r["stages"].get(name, 0.0) for r in records])) for name in names}


def _ttft_over_share(records: Sequence[Mapping[str, Any]], reference: Mapping[str, Mapping[str, Any]]) -> float | None:
    """Median over questions of a method's TTFT over its share of full's: its compute fraction times full's
    TTFT on the same question (1.0: as fast per token-layer as a full prefill; above it, the fixed costs
    of fusing and the work a token-layer count misses). None if a question's fraction is 0."""
    shares = [r["compute_fraction"] * reference[r["id"]]["ttft_s"] for r in records]
    return median_ratio([r["ttft_s"] for r in records], shares) if all(s > 0 for s in shares) else None


def _with_ci(name: str, values: Sequence[float | bool | None]) -> dict[str, Any]:
    """`name`: the mean of the present values, `name_ci`: its bootstrap CI (both None when none is present)."""
    present = [float(v) for v in values if v is not None]
    return {name: float(np.mean(present)) if present else None, f"{name}_ci": list(bootstrap_ci(present)) if present else None}


def _paired(name: str, mine: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """`name_diff`: mean over questions of (this - baseline), `name_diff_ci`: its bootstrap CI."""
    diffs = [mine[q] - baseline[q] for q in mine if q in baseline and mine[q] is not None and baseline[q] is not None]
    return {f"{name}_diff": float(np.mean(diffs)) if diffs else None,
            f"{name}_diff_ci": list(bootstrap_ci(diffs)) if diffs else None}


def _fidelity_columns(
    scores: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Each fidelity measure's mean and CI over `scores` (one per question, with its `id`), and its
    paired difference from `baseline`'s scores of the same questions."""
    out: dict[str, Any] = {}
    for key in FIDELITY_KEYS:
        out |= _with_ci(key, [s[key] for s in scores])
        if baseline is not None:
            out |= _paired(key, {s["id"]: s[key] for s in scores}, {b["id"]: b[key] for b in baseline})
    return out


def _planted(mine: Sequence[Mapping[str, Any]], reference: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Exact-string datasets: `planted_accuracy` among the questions full answers correctly (with its
    CI and how many there are), `planted_distractor` the share of those answered with a distractor
    (another question's fact in the prompt), and `exact_accuracy` over all questions."""
    if all(r["exact_hit"] is None for r in mine):
        return {}
    eligible = [r for r in mine if reference[r["id"]]["exact_hit"]]
    return {**_with_ci("planted_accuracy", [r["exact_hit"] for r in eligible]), "planted_n": len(eligible),
            **_with_ci("planted_distractor", [r.get("distractor_hit") for r in eligible]),
            "exact_accuracy": _mean([r["exact_hit"] for r in mine])}


def summarise(
    records: Sequence[Mapping[str, Any]], variants: Sequence[Variant], baseline: Variant | None = None
) -> list[dict[str, Any]]:
    """One entry per variant: latency percentiles, paired speedup over `full`, fidelity to `full`
    (means, bootstrap CIs, paired differences from `baseline`), secondary quality metrics; then the
    noise-floor entry (`full` with bfloat16-rounded K/V), which has fidelity columns only."""
    reference = {r["id"]: r for r in records if r["label"] == REFERENCE}
    base = [r for r in records if baseline is not None and r["label"] == baseline.label] or None
    summary = []
    for variant in variants:
        mine = [r for r in records if r["label"] == variant.label]
        if not mine:
            continue
        ttft = median_p90([r["ttft_s"] for r in mine])
        summary.append({
            "method": variant.method, "params": dict(variant.params), "caches": variant.caches, "n": ttft["n"],
            "ttft_median_s": ttft["median"], "ttft_p90_s": ttft["p90"],
            "speedup_vs_full": median_ratio([reference[r["id"]]["ttft_s"] for r in mine], [r["ttft_s"] for r in mine]),
            "ttft_over_share": _ttft_over_share(mine, reference),
            "baseline": None if base is None else baseline.label,
            **_fidelity_columns(mine, base),
            **_planted(mine, reference),
            "f1_gold": _mean([r["f1_gold"] for r in mine]),
            "rouge_l_gold": _mean([r["rouge_l_gold"] for r in mine]),
            "f1_vs_full": _mean([r["f1_vs_full"] for r in mine]),
            "recompute_fraction": _mean([r["recompute_fraction"] for r in mine]),
            "chunk_tokens_matched": _mean([r.get("chunk_tokens_matched") for r in mine]),
            "compute_fraction": _mean([r["compute_fraction"] for r in mine]),
            "retrieval_median_s": float(np.median([r["retrieval_s"] for r in mine])),
            "prompt_tokens_median": float(np.median([r["prompt_tokens"] for r in mine])),
            "stage_median_s": _stage_medians(mine),
        })
    floors = [{"id": qid, **r["noise_floor"]} for qid, r in reference.items() if "noise_floor" in r]
    if floors:
        summary.append({
            "method": REFERENCE, "params": dict(NOISE_FLOOR), "n": len(floors), "noise_floor": True,
            "baseline": None if base is None else baseline.label, **_fidelity_columns(floors, base),
        })
    return summary


# ---- resuming ------------------------------------------------------------------------------------------
PLAN_FILE = "plan.json"


def finished_records(
    path: Path, run_plan: Mapping[str, Any], examples: Sequence[QAExample], variants: Sequence[Variant]
) -> list[dict[str, Any]]:
    """The records of the questions an earlier run finished, read back from `path` (`records.jsonl`).

    Refuses records measured under another plan or for questions this dataset does not ask; drops a
    torn last line (the run was killed mid-write) and any question not every variant answered.
    """
    if not path.is_file():
        return []
    plan_path = path.with_name(PLAN_FILE)
    if not plan_path.is_file():
        raise ValueError(f"cannot resume from {path}: {plan_path} is missing, so its settings are unknown; "
                         "use a new --out or drop --resume")
    earlier = json.loads(plan_path.read_text(encoding="utf-8"))
    current = json.loads(json.dumps(run_plan))  # tuples as lists, as the file holds them
    changed = {key: (earlier.get(key), new) for key, new in current.items() if earlier.get(key) != new}
    if changed:
        detail = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
        raise ValueError(f"cannot resume from {path}: the run's settings changed ({detail})")

    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for n, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if n < len(lines):
                raise ValueError(f"{path}:{n}: not a JSON record ({err})") from err
            log.warning("%s:%d: dropping a torn last line", path, n)

    questions = {ex.id: ex.question for ex in examples}
    answered: dict[str, set[str]] = {}
    for r in records:
        if questions.get(r["id"]) != r["question"]:
            raise ValueError(f"cannot resume from {path}: question {r['id']!r} ({r['question']!r}) is not in this "
                             "dataset (a different file or --limit?)")
        answered.setdefault(r["id"], set()).add(r["label"])
    labels = {v.label for v in variants}
    complete = {qid for qid, seen in answered.items() if seen == labels}
    if len(complete) < len(answered):
        log.warning("%s: dropping %d question(s) not every variant answered", path, len(answered) - len(complete))
    return [r for r in records if r["id"] in complete]


# ---- the run --------------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    out_dir: Path
    summary: list[dict[str, Any]]
    records: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)


def run_benchmark(
    examples: Sequence[QAExample],
    out_dir: Path,
    config: Config = Config(),
    settings: BenchSettings = BenchSettings(),
    adapter: ModelAdapter | None = None,
    meta: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> BenchResult:
    """Index `examples`' passages under `out_dir/work`, run every variant on every question, and write
    `records.jsonl` (as it goes), then `results.json`, `results.md` and `pareto.png`, into `out_dir`.

    `adapter` injects a loaded model (tests use a tiny one); by default `config.model` is loaded.
    """
    if not examples:
        raise ValueError("no examples to benchmark")
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"example ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    out_dir = Path(out_dir)
    torch.set_num_threads(settings.threads)
    adapter = adapter or ModelAdapter.load(config)
    controller = None
    config, decision = resolve_ratio(config, adapter)  # before indexing, so a missing calibration fails at once
    if decision is not None:
        log.info("loading controller: %s", decision.explain())
        controller = {**asdict(decision), "explain": decision.explain()}
    variants = plan(settings, config.fusion, config)
    for variant in variants:  # a bad CacheBlend schedule fails now, not after the indexing
        if variant.method == "cacheblend":
            filter_schedule(variant.fusion(config.fusion), adapter.layout.n_layers)
    baseline = parse_variant(settings.baseline, config.fusion, config)
    log.info("benchmarking %d questions x %d variants: %s (baseline %s)", len(examples), len(variants),
             ", ".join(v.label for v in variants), baseline.label)

    # What must not change between an interrupted run and its resumption, or the records would not compare.
    run_plan = {
        "model": config.model, "dtype": config.dtype, "chunk_tokens": config.chunk_tokens, "top_k": config.top_k,
        "chunk_prefill": config.chunk_prefill, "fusion": asdict(config.fusion),
        "max_new_tokens": config.generation.max_new_tokens, "variants": [v.label for v in variants],
        "machine": machine_id(adapter.device), "torch": torch.__version__, "threads": settings.threads,
        "prompt_style": settings.prompt_style,
    }
    records_path = out_dir / "records.jsonl"  # read before indexing: a refused resume leaves --out as it was
    records = finished_records(records_path, run_plan, examples, variants) if settings.resume else []
    done = {r["id"] for r in records}

    index, indexing = build_index(examples, out_dir / "work", config, adapter, progress)
    generators: dict[str | None, FusedGenerator] = {None: FusedGenerator(index)}
    other_indexing = {}
    for caches in dict.fromkeys(v.caches for v in variants if v.caches is not None):  # same corpus, other caches
        other, other_indexing[caches] = build_index(
            examples, out_dir / "work", made_with(config, caches), adapter, progress, f"index-{caches}")
        generators[caches] = FusedGenerator(other)
    run_meta = {
        **(meta or {}), **run_plan, "questions": len(examples), "warmup_questions": min(settings.warmup, len(examples)),
        "indexing": indexing.to_dict(), "controller": controller, "started": _now(),
        **{f"indexing_{caches}": stats.to_dict() for caches, stats in other_indexing.items()},
    }
    if settings.resume:
        log.info("resuming: %d of %d questions already measured in %s", len(done), len(examples), records_path)
        run_meta["resumed_questions"] = len(done)
    atomic_write(out_dir / PLAN_FILE, (json.dumps(run_plan, indent=2) + "\n").encode("utf-8"))
    atomic_write(records_path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))

    facts = frozenset(a for e in examples if e.task == "exact" for a in e.answers)
    for example in tqdm(examples[: settings.warmup], desc="warm-up", disable=not progress):
        run_question(generators, example, variants, 0, settings.prompt_style, facts)

    bar = tqdm(total=len(examples) * len(variants), initial=len(records), unit="run", desc="bench",
               disable=not progress)
    try:
        for i, example in enumerate(examples):
            if example.id in done:
                continue
            new = run_question(generators, example, variants, i, settings.prompt_style, facts)  # i: the same rotation when resumed
            with records_path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            records += new
            bar.update(len(new))
            bar.set_postfix(_headline(records, variants), refresh=False)
    finally:  # an interrupted run still reports the questions it finished
        bar.close()
        if records:
            run_meta |= {"questions_done": len(records) // len(variants), "finished": _now(),
                         "baseline": baseline.label, **_evidence(records)}
            write_report(summarise(records, variants, baseline), records, out_dir, run_meta)
    return BenchResult(out_dir, summarise(records, variants, baseline), records, run_meta)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _headline(records: Sequence[Mapping[str, Any]], variants: Sequence[Variant]) -> dict[str, str]:
    """Progress-bar postfix: the running speedup and teacher-forced KL of each method at its default
    setting (its first variant)."""
    firsts = {v.method: v for v in reversed(variants) if v.method != REFERENCE}
    out = {}
    for method, variant in reversed(firsts.items()):
        mine = {r["id"]: r for r in records if r["label"] == variant.label}
        kl = _mean([r["tf_kl"] for r in mine.values()])
        speedup = median_ratio([r["ttft_s"] for r in records if r["label"] == REFERENCE and r["id"] in mine],
                               [r["ttft_s"] for r in mine.values()])
        out[method] = f"{speedup:.1f}x" + ("" if kl is None else f" kl {kl:.3g}")
    return out


def _evidence(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Planted facts: how many questions' fact-holding chunk retrieval found (placed at its rank)."""
    planted = {r["id"]: r["evidence_retrieved_rank"] for r in records if r["label"] == REFERENCE and r["exact_hit"] is not None}
    if not planted:
        return {}
    return {"planted_questions": len(planted), "evidence_retrieved": sum(rank is not None for rank in planted.values())}
