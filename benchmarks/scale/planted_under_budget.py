"""Planted facts under a disk budget: does an index whose caches do not all fit keep the facts the default keeps?

Runs `rag-kvcache bench` twice on the same planted questions, same settings (`epic_match`, the default, against
`full`; facts left where retrieval ranks them, best last): once with no budget (every chunk's two caches made at
indexing), once with `--kv-budget` at `--share` of the bytes the first run's caches took (the chunks most central
among the corpus' embeddings cached first; a retrieved chunk without a cache computed in the request behind the
prefix and stored if the budget admits it; no neighbour cache made later, as `serve` would when quiet). Then pairs
the two runs question by question: the facts `full` answers, and of those, the ones `epic_match` keeps in each run,
with the discordant pairs and an exact two-sided sign test (McNemar) on them.

With `--rounds N`, the budget run's index (a copy of it, so the bench run stays resumable) then answers the same
questions N more times in this process, as a server would: the same retrieval, layout and variants as `bench`
(`bench.runner.run_question`, fidelity included, so each prompt's chunks are read twice a question as in the
bench), and after each question the library's own backfill (`CacheOpener.backfill`, called as
`Server._make_wanted` calls it, until nothing is wanted) makes the caches the prompts wanted and the budget
admits: a first chunk's behind-prefix cache at its first read, a later chunk's neighbour cache once the ledger has
counted it read `MADE_AT_USES` times (until then a prompt computes that chunk in the request). The last round is paired with the no-budget run and with the bench's budget run as above,
and each round's chunk reads are told apart: computed in the request, read from a cache the hot set held (made
at indexing), or from one backfill made; behind the prefix as the first chunk, or the neighbour cache.

    python benchmarks/scale/planted_under_budget.py ../shared/data/musique_dev.json --limit 40 --out /tmp/pub
    python benchmarks/scale/planted_under_budget.py ../shared/data/musique_dev.json --limit 20 --rounds 2 \
        --out /tmp/pub2

writes `--out`/planted-under-budget.json (and prints it), and with `--rounds` `--out`/planted-under-budget-
backfilled.json (the same, and the rounds'); the two bench folders stay under `--out`, the rounds' index and
records (`round<r>.jsonl`, the bench's budget run being round 1) under `--out`/backfilled.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.runner import asked_as, run_question
from rag_kvcache.bench.variants import BenchSettings, parse_methods, plan
from rag_kvcache.cli.common import base_config
from rag_kvcache.engine.cache import ChunkKV
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.addressing import address
from rag_kvcache.store.controller import resolve_ratio
from rag_kvcache.store.opening import PromptCaches

CLI = str(Path(sys.executable).with_name("rag-kvcache"))


CHUNK_TOKENS, METHODS, BASELINE, EVIDENCE, CHUNK_ORDER = 512, "full,epic_match", "epic_match", "retrieved", "best_last"
MAX_NEW_TOKENS, THREADS = 32, 2  # `bench`'s defaults


def bench(dataset: Path, limit: int, out: Path, budget: int | None) -> None:
    """One `bench` run into `out` (resumed if `out` holds a finished part of the same run)."""
    command = [
        CLI, "bench", "--dataset", f"planted:{dataset}", "--limit", str(limit), "--chunk-tokens", str(CHUNK_TOKENS),
        "--methods", METHODS, "--baseline", BASELINE, "--evidence", EVIDENCE,
        "--chunk-order", CHUNK_ORDER, "--out", str(out),
    ]  # fmt: skip
    if budget is not None:
        command += ["--kv-budget", str(budget)]
    if (out / "records.jsonl").is_file():
        command.append("--resume")
    subprocess.run(command, check=True)


def cache_bytes(out: Path) -> int:
    """Bytes of the chunk caches of a bench run's index."""
    return sum(p.stat().st_size for p in (out / "work" / "index" / "kv").glob("??/*.safetensors"))


def hits(out: Path, name: str = "records.jsonl") -> dict[str, dict[str, bool]]:
    """question id -> method -> whether its answer holds the planted fact (records `out`/`name`)."""
    found: dict[str, dict[str, bool]] = {}
    for line in (out / name).read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        found.setdefault(r["id"], {})[r["method"]] = bool(r["exact_hit"])  # the label carries the variant's k
    return found


def sign_test(b: int, c: int) -> float:
    """Exact two-sided p of `b` against `c` discordant pairs under no difference."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(
    answered: Sequence[str], first: dict[str, dict[str, bool]], second: dict[str, dict[str, bool]]
) -> dict[str, Any]:
    """Of the facts `answered` (`full`, no budget), those `epic_match` keeps in `first` and in `second`, the
    discordant pairs and their sign test."""
    kept_first = {i for i in answered if first[i]["epic_match"]}
    kept_second = {i for i in answered if second[i]["epic_match"]}
    only_first, only_second = sorted(kept_first - kept_second), sorted(kept_second - kept_first)
    return {
        "kept_first": len(kept_first),
        "kept_second": len(kept_second),
        "kept_only_first": only_first,
        "kept_only_second": only_second,
        "sign_test_p": sign_test(len(only_first), len(only_second)),
    }


# a chunk read, by where its K/V came from
IN_REQUEST = "computed in the request"
FIRST = "first chunk, its behind-prefix cache"
NEIGHBOURS = "later chunk, its neighbour cache"


class Reads:
    """Records the chunk reads of the prompts `CacheOpener.open` opens, and the caches `backfill` makes (wrapping
    the index's opener and its memory tier's `put`, nothing else changed): per question, per opening, each
    chunk segment's kind (`IN_REQUEST`, `FIRST`, `NEIGHBOURS`), the keys it read and whether the disk
    held them then (else the memory tier did)."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.question = ""
        self.openings: dict[str, list[list[tuple[str, tuple[str, ...], bool]]]] = {}
        self.hot = disk_keys(index)  # what the budget run left on disk: the hot set (made at indexing)
        self.backfilled: set[str] = set()  # caches `backfill` made: stored, or kept in memory (a neighbour's)
        self.backfilling = False
        opener, memory = index.caches, index.store.memory
        self._open: Callable[..., PromptCaches] = opener.open
        self._put: Callable[[str, ChunkKV], None] = memory.put
        opener.open = self.open  # type: ignore[method-assign]
        memory.put = self.put  # type: ignore[method-assign]

    def backfill(self) -> int:
        """What `Server._make_wanted` does between requests, `backfill(1)` until nothing is wanted; how many
        caches were stored. Each call's new disk entries are counted as backfill's."""
        made, self.backfilling = 0, True
        try:
            while self.index.caches.wanted:
                before = disk_keys(self.index)
                made += self.index.caches.backfill(1)
                self.backfilled |= disk_keys(self.index) - before
        finally:
            self.backfilling = False
        return made

    def put(self, key: str, kv: ChunkKV) -> None:
        if self.backfilling and key not in self.index.store.disk:  # made now, kept in memory only
            self.backfilled.add(key)
        self._put(key, kv)

    def open(
        self, segments: Sequence[Segment], salt: str = "", make: bool = True, in_place: bool = False
    ) -> PromptCaches:
        on_disk = disk_keys(self.index)
        caches = self._open(segments, salt, make, in_place)
        addressing = self.index.addressing
        reads: list[tuple[str, tuple[str, ...], bool]] = []
        for seg, at, source in zip(segments, address(addressing, segments, salt), caches.sources):
            if not (seg.cacheable and seg.label.startswith("chunk")):
                continue
            if source is None:
                kind, keys = IN_REQUEST, ()
            else:
                kind, keys = FIRST if at.context == addressing.chunk_context else NEIGHBOURS, at.keys
            reads.append((kind, keys, on_disk.issuperset(keys)))
        self.openings.setdefault(self.question, []).append(reads)
        return caches

    def origin(self, keys: tuple[str, ...]) -> str:
        if not keys:
            return IN_REQUEST
        if all(k in self.backfilled for k in keys):
            return "made by backfill"
        return "hot set (made at indexing)" if all(k in self.hot for k in keys) else "neither"

    def counts(self) -> dict[str, Any]:
        """This round's reads (the answer's opening of each question), by kind, origin and tier."""
        by_kind: Counter[str] = Counter()
        by_origin: Counter[str] = Counter()
        by_both: Counter[str] = Counter()
        from_memory: Counter[str] = Counter()
        differing = []
        for qid, openings in self.openings.items():
            if len(openings) != 2 or openings[0] != openings[1]:
                differing.append(qid)  # the answer's and the fidelity's opening should read alike
            for kind, keys, on_disk in openings[0]:
                origin = self.origin(keys)
                by_kind[kind] += 1
                by_origin[origin] += 1
                by_both[f"{kind} | {origin}"] += 1
                if keys and not on_disk:
                    from_memory[origin] += 1
        return {
            "chunk_reads_by_kind": dict(by_kind),
            "chunk_reads_by_origin": dict(by_origin),
            "chunk_reads_by_kind_and_origin": dict(by_both),
            "chunk_reads_not_on_disk_read_from_memory_by_origin": dict(from_memory),
            "questions_whose_two_openings_differ": differing,
        }


def disk_keys(index: KVIndex) -> set[str]:
    return {path.stem for path in index.store.disk.files()}


def rounds_after(
    musique: Path, limit: int, budget: int, budget_dir: Path, rounds_dir: Path, rounds: int
) -> list[dict[str, Any]]:
    """`rounds` more rounds of the bench's questions on a copy of the budget run's index (`rounds_dir`/work), the
    library's backfill run after each question; each round's records in `rounds_dir`/round<r>.jsonl (r from 2).
    Returns each round's counts: its chunk reads by kind and by the origin of the cache read, what backfill made."""
    if rounds_dir.exists():  # the rounds start from the index the budget run left, every time
        shutil.rmtree(rounds_dir)
    shutil.copytree(budget_dir / "work", rounds_dir / "work")
    torch.set_num_threads(THREADS)
    config = base_config().with_index(chunk_tokens=CHUNK_TOKENS).with_query(chunk_order=CHUNK_ORDER)
    config = config.with_generation(max_new_tokens=MAX_NEW_TOKENS).with_storage(disk_bytes=budget)
    adapter = ModelAdapter.load(config)
    config = resolve_ratio(config, adapter)[0]  # as `run_benchmark` does
    config = config.with_query(fusion=config.query.fusion.for_chunks(config.index.chunk_tokens))
    settings = BenchSettings(methods=parse_methods(METHODS), baseline=BASELINE, evidence=EVIDENCE, threads=THREADS)
    variants = plan(settings, config.query.fusion, config)
    ours = asked_as(config, variants)
    bench_plan = json.loads((budget_dir / "plan.json").read_text(encoding="utf-8"))
    if differs := {
        k: (bench_plan.get(k), v) for k, v in json.loads(json.dumps(ours)).items() if bench_plan.get(k) != v
    }:
        raise SystemExit(f"the rounds would not ask as the bench did: {differs}")
    examples = load_dataset(f"planted:{musique}", top_k=config.query.top_k)[:limit]
    facts = frozenset(a for e in examples if e.task == "exact" for a in e.answers)
    index = KVIndex.open(rounds_dir / "work" / "index", config, adapter)
    generators: dict[str | None, FusedGenerator] = {None: FusedGenerator(index)}
    reads = Reads(index)
    out = []
    for r in range(2, rounds + 2):
        t0, made, made_in_request = time.perf_counter(), 0, set()
        reads.openings = {}
        with (rounds_dir / f"round{r}.jsonl").open("w", encoding="utf-8") as f:
            for i, example in enumerate(examples):
                reads.question = example.id
                before = disk_keys(index)
                records = run_question(generators, example, variants, i, settings.prompt_style, facts, False)
                f.writelines(json.dumps(rec) + "\n" for rec in records)
                f.flush()
                made_in_request |= disk_keys(index) - before  # none expected: under a budget none is stored then
                made += reads.backfill()
        on_disk = disk_keys(index)
        out.append(
            {
                "round": r,
                "seconds": time.perf_counter() - t0,
                **reads.counts(),
                "caches_stored_by_backfill_after_the_rounds_questions": made,
                "caches_stored_during_a_request": len(made_in_request),
                "backfill_made_so_far": len(reads.backfilled),
                "backfill_made_on_disk_after": len(reads.backfilled & on_disk),
                "hot_set_on_disk_after": len(reads.hot & on_disk),
                "hot_set_before": len(reads.hot),
                "cache_bytes_after": sum(p.stat().st_size for p in index.store.disk.files()),
            }
        )
        print(json.dumps(out[-1], indent=2), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("musique", type=Path, help="the MuSiQue dev set in CacheBlend's layout (datasets/musique.md)")
    parser.add_argument("--limit", type=int, default=40, help="questions (default 40)")
    parser.add_argument("--share", type=float, default=0.1, help="the budget, a share of the default's cache bytes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="rounds asked again on the budget run's index, backfill after each question",
    )
    args = parser.parse_args()
    default_dir, budget_dir = args.out / "default", args.out / "budget"
    bench(args.musique, args.limit, default_dir, None)
    full_bytes = cache_bytes(default_dir)
    budget = int(args.share * full_bytes)
    bench(args.musique, args.limit, budget_dir, budget)

    default, under = hits(default_dir), hits(budget_dir)
    ids = sorted(default)
    if sorted(under) != ids:
        raise SystemExit(f"the two runs asked other questions: {sorted(set(default) ^ set(under))}")
    full_disagree = [i for i in ids if default[i]["full"] != under[i]["full"]]
    answered = [i for i in ids if default[i]["full"]]  # the facts `full` answers (the default run's)
    kept_default = {i for i in answered if default[i]["epic_match"]}
    kept_budget = {i for i in answered if under[i]["epic_match"]}
    only_default, only_budget = len(kept_default - kept_budget), len(kept_budget - kept_default)
    meta = json.loads((budget_dir / "results.json").read_text(encoding="utf-8")).get("meta", {})
    result = {
        "command": " ".join(sys.argv),
        "questions": len(ids),
        "default_cache_bytes": full_bytes,
        "budget_bytes": budget,
        "budget_cache_bytes_after": cache_bytes(budget_dir),
        "facts_full_answers": len(answered),
        "full_differs_between_runs": full_disagree,
        "kept_by_epic_match_default": len(kept_default),
        "kept_by_epic_match_under_budget": len(kept_budget),
        "kept_only_by_default": only_default,
        "kept_only_under_budget": only_budget,
        "sign_test_p": sign_test(only_default, only_budget),
        "budget_run_indexing": meta.get("indexing"),
    }
    (args.out / "planted-under-budget.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    if args.rounds < 1:
        return

    rounds_dir = args.out / "backfilled"
    per_round = rounds_after(args.musique, args.limit, budget, budget_dir, rounds_dir, args.rounds)
    last = hits(rounds_dir, f"round{args.rounds + 1}.jsonl")
    if sorted(last) != ids:
        raise SystemExit(f"the last round asked other questions: {sorted(set(default) ^ set(last))}")
    result |= {
        "rounds_after_the_budget_run": args.rounds,
        "rounds": per_round,
        "last_round": args.rounds + 1,
        "full_differs_last_round_from_default": [i for i in ids if default[i]["full"] != last[i]["full"]],
        "last_round_vs_default": paired(answered, default, last),
        "last_round_vs_budget_round_1": paired(answered, under, last),
        "kept_by_epic_match_by_round": [len(kept_budget)]
        + [
            sum(hits(rounds_dir, f"round{r}.jsonl")[i]["epic_match"] for i in answered)
            for r in range(2, args.rounds + 2)
        ],
    }
    path = args.out / "planted-under-budget-backfilled.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
