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
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import Config
from ..engine.methods import filter_schedule
from ..engine.model import ModelAdapter
from ..query.answers import Answer
from ..query.generator import FusedGenerator
from ..retrieval.records import Hit
from ..store.controller import machine_id, resolve_ratio
from .corpus import build_index, chunk_tokens_matched, distractors_in, place_evidence
from .datasets import QAExample
from .fidelity import fidelity
from .metrics import contains_answer, max_f1, rouge_l
from .prompts import NATIVE, style_messages
from .report import atomic_write, write_report
from .summary import evidence, headline, summarise
from .variants import REFERENCE, BenchSettings, Variant, made_with, parse_variant, plan, rotated

log = logging.getLogger(__name__)

OTHER_STAGE = "other"  # TTFT not inside a prefill stage: decoder setup and first-token sampling


def _stages(answer: Answer) -> dict[str, float]:
    return {**answer.stages, OTHER_STAGE: max(0.0, answer.ttft_s - sum(answer.stages.values()))}


def _record(
    example: QAExample,
    variant: Variant,
    slot: int,
    answer: Answer,
    reference: Answer,
    retrieval_s: float,
    fidelity: Mapping[str, float | None],
    evidence: int | None,
    placed: int | None,
    distractors: Sequence[str],
) -> dict[str, Any]:
    summarisation = example.task == "summarization"
    hit = contains_answer(answer.answer, example.answers) if example.task == "exact" else None
    return {
        "id": example.id,
        "question": example.question,
        "gold": list(example.answers),
        "method": variant.method,
        "params": dict(variant.params),
        "caches": variant.caches,
        "label": variant.label,
        "slot": slot,
        "answer": answer.answer,
        "ttft_s": answer.ttft_s,
        "retrieval_s": retrieval_s,
        "prompt_tokens": answer.prompt_tokens,
        "recomputed_tokens": answer.recomputed_tokens,
        "recompute_fraction": answer.recomputed_tokens / answer.prompt_tokens,
        "compute_fraction": answer.compute_fraction,
        "generation_s": answer.generation_s,
        "generated_tokens": answer.generated_tokens,
        "cache_misses": answer.cache_misses,
        "chunks": [c.id for c in answer.chunks],
        "stages": _stages(answer),
        "f1_gold": max_f1(answer.answer, example.answers) if example.answers else None,
        "f1_vs_full": max_f1(answer.answer, [reference.answer]),
        "rouge_l_gold": max(rouge_l(answer.answer, a) for a in example.answers) if summarisation else None,
        "exact_hit": hit,
        "distractor_hit": None
        if hit is None
        else (not hit and bool(distractors) and contains_answer(answer.answer, distractors)),
        "evidence_retrieved_rank": evidence,
        "evidence_rank": placed,
        **fidelity,
    }


def run_question(
    generators: Mapping[str | None, FusedGenerator],
    example: QAExample,
    variants: Sequence[Variant],
    slot_shift: int,
    prompt_style: str = NATIVE,
    facts: frozenset[str] = frozenset(),
    move_evidence: bool = True,
) -> list[dict[str, Any]]:
    """Retrieve once, answer with every variant (rotated by `slot_shift`) on its caches' index
    (`generators[variant.caches]`; None: the run's index) in the `prompt_style` layout, and score
    against `full` on the same prompt. `facts`: the run's exact answers; those of other questions that
    a retrieved chunk holds are this question's distractors. The chunks are laid out in the config's
    `chunk_order`; a planted fact's chunk is then moved to its drawn place (`move_evidence=False`: left there)."""
    generator = generators[None]
    config = generator.index.config
    t0 = time.perf_counter()
    ranked: list[Hit] = generator.index.search(example.question, config.query.top_k)
    retrieval_s = time.perf_counter() - t0
    laid_out = config.query.in_prompt_order(ranked)
    hits, at = place_evidence(laid_out, example, move_evidence)
    fact = None if at is None else laid_out[at]  # the chunk holding the planted fact
    evidence = None if fact is None else ranked.index(fact)  # the rank retrieval gave it
    placed = None if fact is None else hits.index(fact)  # its place in the prompt
    distractors = distractors_in(hits, example, facts)
    order = rotated(variants, slot_shift)
    if prompt_style == NATIVE:
        answers = {
            v: generators[v.caches].ask(
                example.question, hits, fusion=v.fusion(config.query.fusion), generation=config.query.generation
            )
            for v in order
        }
        fmt = generator.index.format
        segments = fmt.segments(
            [h.chunk.token_ids for h in hits], fmt.question_ids(generator.adapter.tokenizer, example.question)
        )
    else:  # the prompt a pipeline of this style sends, the chunks found in it (matching timed in the TTFT)
        prompt = style_messages(prompt_style, [h.chunk.text for h in hits], example.question)
        answers = {
            v: generators[v.caches].complete(
                prompt, fusion=v.fusion(config.query.fusion), generation=config.query.generation
            )
            for v in order
        }
        segments = generator.layout.prompt_segments(prompt)
    scores, floor = fidelity(generators, segments, variants, config)
    reference = answers[Variant(REFERENCE)]
    records = [
        _record(
            example, v, order.index(v), answers[v], reference, retrieval_s, scores[v], evidence, placed, distractors
        )
        for v in variants
    ]
    records[variants.index(Variant(REFERENCE))]["noise_floor"] = floor
    matched = chunk_tokens_matched(segments, hits)
    for r in records:
        r |= {"chunks": [h.chunk.id for h in hits], "chunk_tokens_matched": matched}
    return records


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
        raise ValueError(
            f"cannot resume from {path}: {plan_path} is missing, so its settings are unknown; "
            "use a new --out or drop --resume"
        )
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
            raise ValueError(
                f"cannot resume from {path}: question {r['id']!r} ({r['question']!r}) is not in this "
                "dataset (a different file or --limit?)"
            )
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


def asked_as(config: Config, variants: Sequence[Variant]) -> dict[str, Any]:
    """What a run asks with, as its `plan.json` records it: the settings that change which prompts are asked and
    how they are fused (the rest of the plan is the machine's and the run's)."""
    return {
        "model": config.index.model,
        "dtype": config.index.dtype,
        "chunk_tokens": config.index.chunk_tokens,
        "top_k": config.query.top_k,
        "chunk_order": config.query.chunk_order,
        "chunk_prefill": config.index.chunk_prefill,
        "kv_budget": config.runtime.storage.disk_bytes,
        "fusion": asdict(config.query.fusion),
        "max_new_tokens": config.query.generation.max_new_tokens,
        "variants": [v.label for v in variants],
    }


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

    `adapter` injects a loaded model (tests use a tiny one); by default `config.index.model` is loaded.
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
    config = config.with_query(fusion=config.query.fusion.for_chunks(config.index.chunk_tokens))  # the plan records k
    if decision is not None:
        log.info("loading controller: %s", decision.explain())
        controller = {**asdict(decision), "explain": decision.explain()}
    variants = plan(settings, config.query.fusion, config)
    for variant in variants:  # a bad CacheBlend schedule fails now, not after the indexing
        if variant.method == "cacheblend":
            filter_schedule(variant.fusion(config.query.fusion), adapter.layout.n_layers)
    baseline = parse_variant(settings.baseline, config.query.fusion, config)
    log.info(
        "benchmarking %d questions x %d variants: %s (baseline %s)",
        len(examples),
        len(variants),
        ", ".join(v.label for v in variants),
        baseline.label,
    )

    # What must not change between an interrupted run and its resumption, or the records would not compare.
    run_plan = {
        **asked_as(config, variants),
        "machine": machine_id(adapter.device),
        "torch": torch.__version__,
        "threads": settings.threads,
        "prompt_style": settings.prompt_style,
        "evidence": settings.evidence,
    }
    records_path = out_dir / "records.jsonl"  # read before indexing: a refused resume leaves --out as it was
    records = finished_records(records_path, run_plan, examples, variants) if settings.resume else []
    done = {r["id"] for r in records}

    index, indexing = build_index(examples, out_dir / "work", config, adapter, progress)
    generators: dict[str | None, FusedGenerator] = {None: FusedGenerator(index)}
    other_indexing = {}
    for caches in dict.fromkeys(v.caches for v in variants if v.caches is not None):  # same corpus, other caches
        other, other_indexing[caches] = build_index(
            examples, out_dir / "work", made_with(config, caches), adapter, progress, f"index-{caches}"
        )
        generators[caches] = FusedGenerator(other)
    run_meta = {
        **(meta or {}),
        **run_plan,
        "questions": len(examples),
        "warmup_questions": min(settings.warmup, len(examples)),
        "indexing": indexing.to_dict(),
        "controller": controller,
        "started": _now(),
        **{f"indexing_{caches}": stats.to_dict() for caches, stats in other_indexing.items()},
    }
    if settings.resume:
        log.info("resuming: %d of %d questions already measured in %s", len(done), len(examples), records_path)
        run_meta["resumed_questions"] = len(done)
    atomic_write(out_dir / PLAN_FILE, (json.dumps(run_plan, indent=2) + "\n").encode("utf-8"))
    atomic_write(records_path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))

    facts = frozenset(a for e in examples if e.task == "exact" for a in e.answers)
    move = settings.evidence == "placed"
    for example in tqdm(examples[: settings.warmup], desc="warm-up", disable=not progress):
        run_question(generators, example, variants, 0, settings.prompt_style, facts, move)

    bar = tqdm(
        total=len(examples) * len(variants), initial=len(records), unit="run", desc="bench", disable=not progress
    )
    try:
        for i, example in enumerate(examples):
            if example.id in done:
                continue
            new = run_question(
                generators, example, variants, i, settings.prompt_style, facts, move
            )  # i: the same rotation when resumed
            with records_path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            records += new
            bar.update(len(new))
            bar.set_postfix(headline(records, variants), refresh=False)
    finally:  # an interrupted run still reports the questions it finished
        bar.close()
        if records:
            run_meta |= {
                "questions_done": len(records) // len(variants),
                "finished": _now(),
                "baseline": baseline.label,
                **evidence(records),
            }
            write_report(summarise(records, variants, baseline), records, out_dir, run_meta)
    return BenchResult(out_dir, summarise(records, variants, baseline), records, run_meta)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
