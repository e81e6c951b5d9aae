"""`rag-kvcache`: index a folder, ask with fused KV, run the demo. The only place that prints or reads
environment variables (`RAG_KVCACHE_CACHE_DIR`: where converted models live)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import statistics
import sys
from dataclasses import asdict, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional, get_args

import transformers
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from .bench.datasets import FORMATS, load_dataset
from .bench.runner import DEFAULT_METHODS, BenchSettings, run_benchmark
from .config import DEFAULT_EMBEDDER, DEFAULT_MODEL, KV_CODECS, Config, Deviation, FusionConfig
from .engine.methods import METHODS
from .generator import FusedGenerator
from .index import KVIndex
from .store.controller import MEASURED_TIERS, choose_ratio, choose_tier, decide
from .store.controller import calibrate as measure
from .store.kvstore import KVStore

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RAG that never prefills the same chunk twice.")
out = Console()
err = Console(stderr=True)

DEMO_DIR = Path(__file__).resolve().parent.parent / "datasets" / "demo"
DEMO_QUESTION = "What is the name of the main telescope of the Veldmark Observatory?"

Method = Enum("Method", {name: name for name in METHODS}, type=str)
KVCodec = Enum("KVCodec", {name: name for name in KV_CODECS}, type=str)
DeviationName = Enum("DeviationName", {name: name for name in get_args(Deviation)}, type=str)


class ChunkTokens(str, Enum):
    t128 = "128"
    t512 = "512"


def _base_config(**changes: object) -> Config:
    cache_dir = os.environ.get("RAG_KVCACHE_CACHE_DIR")
    cfg = Config(**({"cache_dir": Path(cache_dir)} if cache_dir else {}))
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )
    logging.getLogger("rag_kvcache").setLevel(logging.DEBUG if verbose else logging.INFO)
    transformers.utils.logging.disable_progress_bar()  # weight-loading bars are noise here


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


@app.command()
def index(
    docs_dir: Annotated[Path, typer.Argument(help="Folder of text documents.")],
    index_dir: Annotated[Path, typer.Option("--index", help="Where the index and KV caches go.")],
    chunk_tokens: Annotated[Optional[ChunkTokens], typer.Option(help="Chunk size in LLM tokens [default: 512].")] = None,
    model: Annotated[Optional[str], typer.Option(help=f"HF id, local dir or .gguf file [default: {DEFAULT_MODEL}].")] = None,
    embedder: Annotated[Optional[str], typer.Option(help=f"sentence-transformers model [default: {DEFAULT_EMBEDDER}].")] = None,
    hnsw: Annotated[bool, typer.Option(help="HNSW instead of exact search (large corpora).")] = False,
    kv_codec: Annotated[Optional[KVCodec], typer.Option(help="How KV caches are stored [default: none].")] = None,
) -> None:
    """Chunk, embed and precompute KV caches for every file in DOCS_DIR (incremental on re-runs).

    Re-indexing into an existing index keeps the settings it was built with."""
    if not docs_dir.is_dir():
        _fail(f"documents folder not found or not a folder: {docs_dir}")
    given = {"chunk_tokens": chunk_tokens and int(chunk_tokens.value), "model": model, "embedder": embedder}
    given |= {"index_type": "hnsw"} if hnsw else {}
    try:
        if (index_dir / "index.sqlite").exists():
            cfg = KVIndex.config_of(index_dir, _base_config())
            for key, value in given.items():
                if value is not None and value != getattr(cfg, key):
                    _fail(f"{index_dir} was built with {key}={getattr(cfg, key)!r}, not {value!r}: use a new --index")
            if kv_codec is not None and kv_codec.value != cfg.storage.codec:
                _fail(f"{index_dir} stores KV caches as {cfg.storage.codec!r}, not {kv_codec.value!r}: use a new --index")
        else:
            cfg = _base_config(**given).with_storage(codec=kv_codec.value if kv_codec else "none")
        idx = KVIndex.create(index_dir, cfg)
        report = idx.update(docs_dir)
    except (OSError, ValueError) as e:  # OSError: missing folders, a full disk (StorageFullError)
        _fail(str(e))
    out.print(
        f"indexed {docs_dir}: {len(report.added)} added, {len(report.changed)} changed, {len(report.removed)} removed, "
        f"{len(report.unchanged)} unchanged, {len(report.skipped)} skipped; {len(idx.chunks)} chunks; "
        f"KV {idx.kv_bytes_per_token / 1024:.1f} KiB/token"
    )


RATIO_HELP = ("CacheBlend recompute ratio in [0, 1], or 'auto': the loading controller's "
              "(needs `rag-kvcache calibrate`).")
CHECK_LAYER_HELP = "CacheBlend check layer."
FILTER_STEPS_HELP = "CacheBlend gradual filtering: narrow the selection to --ratio over this many layers."
DEVIATION_HELP = "CacheBlend: select the tokens whose K (or V) deviates most from the cache."


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    index_dir: Annotated[Path, typer.Option("--index", help="An index built by `rag-kvcache index`.")],
    method: Annotated[Method, typer.Option(help="Fusion method.")] = Method.cacheblend,
    top_k: Annotated[int, typer.Option(min=1, help="Chunks to retrieve.")] = 6,
    ratio: Annotated[str, typer.Option(help=RATIO_HELP)] = "0.15",
    check_layer: Annotated[int, typer.Option(min=0, help=CHECK_LAYER_HELP)] = 1,
    filter_steps: Annotated[int, typer.Option(min=1, help=FILTER_STEPS_HELP)] = 1,
    deviation: Annotated[DeviationName, typer.Option(help=DEVIATION_HELP)] = DeviationName.k,
    epic_k: Annotated[int, typer.Option(min=0, help="EPIC: recomputed leading tokens per chunk.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.9,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Override the index's model.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    stream: Annotated[bool, typer.Option(help="Stream tokens as they come (text output only).")] = False,
) -> None:
    """Answer QUESTION from the index, fusing the retrieved chunks' KV caches."""
    if not question.strip():
        _fail("the question is empty")
    try:
        meta_cfg = KVIndex.config_of(index_dir, _base_config())
        cfg = replace(meta_cfg, model=model or meta_cfg.model, top_k=top_k)
        fixed_ratio = None if ratio == "auto" else _parse_ratio(ratio)
        cfg = cfg.with_fusion(method=method.value, check_layer=check_layer, filter_steps=filter_steps,
                              deviation=deviation.value, epic_k=epic_k)
        cfg = cfg.with_generation(
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature, top_p=top_p, seed=seed,
            stop=tuple(stop or ()),
        )
        idx = KVIndex.open(index_dir, cfg)
        decision = None
        if fixed_ratio is None:
            decision = decide(idx.config, idx.adapter, n_tokens=top_k * cfg.chunk_tokens)
            err.print(f"[dim]loading controller: {decision.explain()}[/dim]")
        fusion = replace(cfg.fusion, ratio=fixed_ratio if decision is None else decision.ratio)
        on_text = (lambda t: out.print(t, end="", highlight=False)) if stream and not as_json else None
        answer = FusedGenerator(idx).ask(question, top_k=top_k, fusion=fusion, on_text=on_text)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if as_json:
        controller = {"controller": asdict(decision)} if decision is not None else {}
        print(json.dumps(answer.to_dict() | controller, indent=2))
        return
    if on_text is None:
        out.print(answer.answer, highlight=False)
    else:
        out.print()
    out.print(
        f"[dim]{answer.method}: ttft {answer.ttft_s * 1000:.0f} ms, retrieval {answer.retrieval_s * 1000:.0f} ms, "
        f"{answer.prompt_tokens} prompt tokens, {answer.recomputed_tokens} recomputed, "
        f"sources: {', '.join(sorted({c.source for c in answer.chunks}))}[/dim]"
    )


def _parse_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--ratio must be a number in [0, 1] or 'auto', got {text!r}")
    return value


@app.command()
def stats(index_dir: Annotated[Path, typer.Option("--index", help="An index built by `rag-kvcache index`.")]) -> None:
    """Print the KV store's counters per tier (totals over every process that used it) and its size."""
    try:
        cfg = KVIndex.config_of(index_dir, _base_config())
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    store = KVStore(index_dir / "kv", cfg.storage)
    table = Table("tier", "hits", "misses", "hit rate", "read", "written", "evictions", "corrupt")
    for tier, s in store.stats().items():
        rate = f"{s.hits / (s.hits + s.misses):.1%}" if s.hits + s.misses else "-"
        table.add_row(
            tier, str(s.hits), str(s.misses), rate, _mib(s.bytes_read), _mib(s.bytes_written), str(s.evictions),
            str(s.corrupt),
        )
    out.print(table)
    sizes = [p.stat().st_size for p in store.disk.files()]
    budget = "unbounded" if cfg.storage.disk_bytes is None else _mib(cfg.storage.disk_bytes)
    out.print(
        f"disk tier: {len(sizes)} entries, {_mib(sum(sizes))} (budget {budget}), codec {cfg.storage.codec}; "
        f"memory tier budget {_mib(cfg.storage.memory_bytes)} per process, eviction {cfg.storage.eviction}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@app.command()
def calibrate(
    index_dir: Annotated[Path, typer.Option("--index", help="Measure for this index's model, codec and disk.")],
    tokens: Annotated[int, typer.Option(min=16, help="Tokens per synthetic chunk cache.")] = 512,
) -> None:
    """Measure tier read speeds and recompute time on this machine (once per model), and show what
    the loading controller would choose."""
    try:
        cfg = KVIndex.config_of(index_dir, _base_config())
        idx = KVIndex.open(index_dir, cfg)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    cal = measure(idx.adapter, index_dir, cfg.storage, cfg.cache_dir, n_tokens=tokens)
    table = Table("tier", "read throughput", "load per layer", "balanced ratio")
    n_tokens = cfg.top_k * cfg.chunk_tokens
    for tier in MEASURED_TIERS:
        d = choose_ratio(cal, tier, n_tokens, cfg.storage.quality_floor)
        table.add_row(tier, f"{cal.read_bytes_per_s[tier] / 2**30:.2f} GiB/s", f"{d.load_s * 1e3:.3f} ms", f"{d.balanced_ratio:.3f}")
    out.print(table)
    out.print(
        f"recompute: {cal.prefill_s_per_token_layer * 1e6:.2f} us per token per layer "
        f"({cal.recompute_s(1.0, n_tokens) * 1e3:.1f} ms per layer for {n_tokens} tokens); "
        f"stored KV: {cal.bytes_per_token_layer:.0f} B per token per layer ({cal.codec})"
    )
    out.print(f"ratio auto (disk): {choose_ratio(cal, 'disk', n_tokens, cfg.storage.quality_floor).explain()}")
    out.print(f"tier for ratio {cfg.fusion.ratio}: {choose_tier(cal, cfg.fusion.ratio, n_tokens).explain()}")


@app.command()
def demo(
    index_dir: Annotated[Path, typer.Option("--index", help="Where to build the demo index.")] = Path("demo-index"),
    question: Annotated[str, typer.Option(help="Question to ask.")] = DEMO_QUESTION,
) -> None:
    """Index the bundled demo folder, then answer with `cacheblend` and compare its TTFT with `full`."""
    cfg = _base_config(chunk_tokens=128, top_k=4)
    out.print(f"[bold]Indexing[/bold] {DEMO_DIR} -> {index_dir}")
    idx = KVIndex.build(DEMO_DIR, index_dir, cfg)
    gen = FusedGenerator(idx)
    methods, repeats = ("full", "cacheblend", "epic"), 3
    hits = idx.search(question, cfg.top_k)
    gen.ask(question, hits, fusion=FusionConfig(method="full"))  # warm-up, not reported
    runs = {m: [] for m in methods}
    for _ in range(repeats):  # alternate methods so machine drift hits all alike
        for m in methods:
            runs[m].append(gen.ask(question, hits, fusion=FusionConfig(method=m)))
    ttft = {m: statistics.median(a.ttft_s for a in runs[m]) for m in methods}
    out.print(f"\n[bold]Q:[/bold] {question}")
    table = Table("method", "answer", f"TTFT (median of {repeats})", "recomputed", "speedup")
    for m in methods:
        a = runs[m][-1]
        table.add_row(
            m, a.answer, f"{ttft[m] * 1000:.0f} ms", f"{a.recomputed_tokens}/{a.prompt_tokens}",
            f"{ttft['full'] / ttft[m]:.1f}x",
        )
    out.print(table)
    out.print(f"[dim]sources: {', '.join(c.source for c in runs['cacheblend'][-1].chunks)}[/dim]")


DatasetFormat = Enum("DatasetFormat", {name: name for name in FORMATS}, type=str)


@app.command()
def bench(
    dataset: Annotated[Path, typer.Option("--dataset", help="QA set: MuSiQue/CacheBlend JSON, LongBench or plain JSONL.")],
    fmt: Annotated[Optional[DatasetFormat], typer.Option("--format", help="Dataset format (default: inferred from the file suffix).")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Use only the first N questions.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated fusion methods; must include full.")] = ",".join(DEFAULT_METHODS),
    chunk_tokens: Annotated[ChunkTokens, typer.Option(help="Chunk size in LLM tokens.")] = ChunkTokens.t512,
    top_k: Annotated[int, typer.Option(min=1, help="Chunks retrieved per question.")] = 6,
    ratio: Annotated[str, typer.Option(help=RATIO_HELP)] = "0.15",
    check_layer: Annotated[int, typer.Option(min=0, help=CHECK_LAYER_HELP)] = 1,
    filter_steps: Annotated[int, typer.Option(min=1, help=FILTER_STEPS_HELP)] = 1,
    deviation: Annotated[DeviationName, typer.Option(help=DEVIATION_HELP)] = DeviationName.k,
    sweep: Annotated[bool, typer.Option(help="Also sweep CacheBlend ratios and EPIC k.")] = False,
    out_dir: Annotated[Path, typer.Option("--out", help="Results and the benchmark's index go here.")] = Path("bench-out"),
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Answer length cap.")] = 32,
    model: Annotated[str, typer.Option(help="HF id, local dir or .gguf file.")] = DEFAULT_MODEL,
    warmup: Annotated[int, typer.Option(min=0, help="Questions run untimed first.")] = 1,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 2,
    resume: Annotated[bool, typer.Option(help="Keep the questions an interrupted run in --out finished and "
                                         "measure the rest (same settings and machine only).")] = False,
) -> None:
    """Index every passage of a QA set, then compare fusion methods on each question: TTFT, speedup
    over full prefill, F1 against the gold answers and against full's answer, first-token agreement, KL."""
    try:
        examples = load_dataset(dataset, fmt and fmt.value)[:limit]
        settings = BenchSettings(
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()), sweep=sweep, warmup=warmup,
            threads=threads, ratio_auto=ratio == "auto", resume=resume,
        )
        cfg = _base_config(chunk_tokens=int(chunk_tokens.value), top_k=top_k, model=model)
        cfg = cfg.with_fusion(check_layer=check_layer, filter_steps=filter_steps, deviation=deviation.value)
        if ratio != "auto":
            cfg = cfg.with_fusion(ratio=_parse_ratio(ratio))
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens)  # greedy: every method decodes alike
        command = shlex.join(["rag-kvcache", *sys.argv[1:]])
        result = run_benchmark(examples, out_dir, cfg, settings, meta={"command": command, "dataset": str(dataset)})
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if result.meta["controller"] is not None:
        out.print(f"loading controller: {result.meta['controller']['explain']}")
    indexing = result.meta["indexing"]
    if indexing["tokens_per_s"] is not None:
        out.print(
            f"indexing: {indexing['tokens']} tokens in {indexing['seconds']:.0f} s = {indexing['tokens_per_s']:.0f} tok/s, "
            f"{indexing['fraction_of_forward']:.2f} of the plain forward ({indexing['forward_tokens_per_s']:.0f} tok/s)"
        )
    out.print((result.out_dir / "results.md").read_text(encoding="utf-8"), markup=False, highlight=False)
