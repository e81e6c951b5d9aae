"""`rag-kvcache demo` and `bench`: the embedded demo, and the benchmark over a QA set."""

from __future__ import annotations

import importlib.util
import shlex
import statistics
import sys
from importlib.resources import as_file, files
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..bench.datasets import EVIDENCE_PLACES
from ..config import FusionConfig, IndexSettings, QueryConfig, RuntimeConfig, StorageConfig
from .common import base_config, fail, model_process, out
from .options import (
    ChunkOrderName,
    ChunkPrefillName,
    DatasetFormat,
    DeviationName,
    DType,
    EmbedderDType,
    EvidencePlace,
    KVBudget,
    KVCodec,
    KVOnDevice,
    KVRemote,
    PromptStyle,
    default,
    fields_of,
    option,
    parse_ratio,
)

DEMO_QUESTION = "What is the name of the main telescope of the Veldmark Observatory?"
# bench.variants.DEFAULT_METHODS (a test keeps them equal)
BENCH_METHODS = "full,prefix,reuse,cacheblend,epic,epic_match"


def demo(
    index_dir: Annotated[Path, typer.Option("--index", help="Where to build the demo index.")] = Path("demo-index"),
    question: Annotated[str, typer.Option(help="Question to ask.")] = DEMO_QUESTION,
    device: Annotated[str, option(RuntimeConfig, "device")] = default(RuntimeConfig, "device"),
    dtype: Annotated[DType, option(IndexSettings, "dtype")] = DType(default(IndexSettings, "dtype")),
) -> None:
    """Index the bundled demo folder, then answer with the default method and `epic`, and compare their TTFT
    with `full`."""
    from ..index import KVIndex
    from ..query.generator import FusedGenerator

    model_process()
    cfg = base_config().with_index(chunk_tokens=128, dtype=dtype.value).with_query(top_k=4).with_runtime(device=device)
    with as_file(files("rag_kvcache") / "demo") as docs:
        out.print(f"[bold]Indexing[/bold] {docs} -> {index_dir}", highlight=False)
        idx = KVIndex.build(docs, index_dir, cfg)
    gen = FusedGenerator(idx)
    methods, repeats = ("full", cfg.query.fusion.method, "epic"), 3
    hits = cfg.query.in_prompt_order(idx.search(question, cfg.query.top_k))
    gen.ask(question, hits, fusion=FusionConfig(method="full"))  # warm-up, not reported
    runs: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):  # alternate methods so machine drift hits all alike
        for m in methods:
            runs[m].append(gen.ask(question, hits, fusion=FusionConfig(method=m)))
    ttft = {m: statistics.median(a.ttft_s for a in runs[m]) for m in methods}
    out.print(f"\n[bold]Q:[/bold] {question}")
    table = Table("method", "answer", f"TTFT (median of {repeats})", "recomputed", "speedup")
    for m in methods:
        a = runs[m][-1]
        table.add_row(
            m,
            a.answer,
            f"{ttft[m] * 1000:.0f} ms",
            f"{a.recomputed_tokens}/{a.prompt_tokens}",
            f"{ttft['full'] / ttft[m]:.1f}x",
        )
    out.print(table)
    out.print(f"[dim]sources: {', '.join(c.source for c in runs[methods[1]][-1].chunks)}[/dim]")


def bench(
    dataset: Annotated[
        Path,
        typer.Option(
            "--dataset",
            help="QA set: MuSiQue/CacheBlend JSON, LongBench or plain JSONL; "
            "planted:MUSIQUE_JSON plants a made-up fact in one passage per question; "
            "planted-paraphrased:MUSIQUE_JSON asks the same facts in other words; "
            "a folder of your own documents, with --questions.",
        ),
    ],
    questions: Annotated[
        Optional[Path],
        typer.Option(
            help="With a documents folder as --dataset: a text file of "
            "questions about it, one per line (no reference answers: the "
            "methods are compared by fidelity to full)."
        ),
    ] = None,
    fmt: Annotated[
        Optional[DatasetFormat],
        typer.Option("--format", help="Dataset format (default: inferred from the file suffix)."),
    ] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Use only the first N questions.")] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated fusion methods, or 'all' (every registered method); "
            "must include full. METHOD:PARAM=VALUE sets its parameter (epic:k=19, "
            "cacheblend:r=0.5); METHOD@CACHES runs METHOD on the caches of an index "
            "over the same corpus built with --chunk-prefill or --kv-codec CACHES, "
            "e.g. reuse@neighbours, cacheblend@none."
        ),
    ] = BENCH_METHODS,
    baseline: Annotated[
        str, typer.Option(help="Method the others' fidelity is compared with, question by question.")
    ] = "cacheblend",
    chunk_tokens: Annotated[int, option(IndexSettings, "chunk_tokens", min=16)] = default(
        IndexSettings, "chunk_tokens"
    ),
    top_k: Annotated[int, option(QueryConfig, "top_k", min=1)] = default(QueryConfig, "top_k"),
    chunk_order: Annotated[ChunkOrderName, option(QueryConfig, "chunk_order")] = ChunkOrderName(
        default(QueryConfig, "chunk_order")
    ),
    chunk_prefill: Annotated[ChunkPrefillName, option(IndexSettings, "chunk_prefill")] = ChunkPrefillName(
        default(IndexSettings, "chunk_prefill")
    ),
    context_chunks: Annotated[int, option(IndexSettings, "context_chunks", min=1)] = default(
        IndexSettings, "context_chunks"
    ),
    ratio: Annotated[str, option(FusionConfig, "ratio")] = str(default(FusionConfig, "ratio")),
    check_layer: Annotated[int, option(FusionConfig, "check_layer", min=0)] = default(FusionConfig, "check_layer"),
    filter_steps: Annotated[int, option(FusionConfig, "filter_steps", min=1)] = default(FusionConfig, "filter_steps"),
    deviation: Annotated[DeviationName, option(FusionConfig, "deviation")] = DeviationName(
        default(FusionConfig, "deviation")
    ),
    sweep: Annotated[bool, typer.Option(help="Also sweep CacheBlend ratios and EPIC k.")] = False,
    out_dir: Annotated[Path, typer.Option("--out", help="Results and the benchmark's index go here.")] = Path(
        "bench-out"
    ),
    max_new_tokens: Annotated[
        int,
        typer.Option(min=1, help="Answer length cap (shorter than ask's: greedy answers are compared with full's)."),
    ] = 32,
    model: Annotated[str, option(IndexSettings, "model")] = default(IndexSettings, "model"),
    embedder: Annotated[str, option(IndexSettings, "embedder")] = default(IndexSettings, "embedder"),
    device: Annotated[str, option(RuntimeConfig, "device")] = default(RuntimeConfig, "device"),
    dtype: Annotated[DType, option(IndexSettings, "dtype")] = DType(default(IndexSettings, "dtype")),
    embedder_dtype: Annotated[EmbedderDType, option(RuntimeConfig, "embedder_dtype")] = EmbedderDType(
        default(RuntimeConfig, "embedder_dtype")
    ),
    warmup: Annotated[int, typer.Option(min=0, help="Questions run untimed first.")] = 1,
    kv_codec: Annotated[KVCodec, option(IndexSettings, "codec")] = KVCodec(default(IndexSettings, "codec")),
    kv_budget: KVBudget = None,
    kv_remote: KVRemote = None,
    kv_on_device: KVOnDevice = default(StorageConfig, "memory_on_device"),
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 2,
    resume: Annotated[
        bool,
        typer.Option(
            help="Keep the questions an interrupted run in --out finished and "
            "measure the rest (same settings and machine only)."
        ),
    ] = False,
    prompt_style: Annotated[
        PromptStyle,
        typer.Option(
            help="Prompt layout: native (our segments), langchain (the "
            "RAG tutorial chain's prompt) or llamaindex (the default "
            "text-QA template); chunks are found in it by their ids."
        ),
    ] = PromptStyle.native,
    evidence: Annotated[
        EvidencePlace,
        typer.Option(
            help="Planted facts: 'placed' moves each fact's chunk to a drawn place in the prompt other than the "
            "first (the hard case: the first chunk is read exactly); 'retrieved' leaves it where retrieval and "
            "--chunk-order put it (the pipeline as a user runs it)."
        ),
    ] = EvidencePlace(EVIDENCE_PLACES[0]),
) -> None:
    """Compare fusion methods on a QA set: TTFT, speedup over full prefill, fidelity to full, F1.

    Indexes every passage of the set, then answers each question with every method. Fidelity is
    teacher-forced: full's greedy answer forced through each method's cache (KL per token, top-1
    agreement, log-probability change, first-token KL), with bootstrap CIs and a paired difference
    from --baseline; planted facts add the accuracy over the facts full answers. F1 is secondary.
    """
    params = dict(locals())
    missing = [name for name in ("matplotlib", "rouge_score") if importlib.util.find_spec(name) is None]
    if missing:
        fail(f"`rag-kvcache bench` needs {', '.join(missing)}: pip install 'rag-kvcache[bench]'")
    from ..bench.datasets import load_dataset
    from ..bench.runner import run_benchmark
    from ..bench.variants import BenchSettings, parse_methods

    model_process()
    try:
        examples = load_dataset(dataset, fmt and fmt.value, top_k=top_k, questions=questions)[:limit]
        settings = BenchSettings(**fields_of(BenchSettings, params, methods=parse_methods(methods)))
        cfg = base_config().with_index(**fields_of(IndexSettings, params, codec=kv_codec.value))
        cfg = cfg.with_query(top_k=top_k, chunk_order=chunk_order.value).with_runtime(
            device=device, embedder_dtype=embedder_dtype.value
        )
        cfg = cfg.with_fusion(
            ratio=parse_ratio(ratio), check_layer=check_layer, filter_steps=filter_steps, deviation=deviation.value
        )
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens)  # greedy: every method decodes alike
        cfg = cfg.with_storage(remote=kv_remote, memory_on_device=kv_on_device, disk_bytes=kv_budget)
        command = shlex.join(["rag-kvcache", *sys.argv[1:]])
        result = run_benchmark(examples, out_dir, cfg, settings, meta={"command": command, "dataset": str(dataset)})
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    if result.meta["controller"] is not None:
        out.print(f"loading controller: {result.meta['controller']['explain']}")
    indexing = result.meta["indexing"]
    if indexing["tokens_per_s"] is not None:
        before, after = indexing["forward_tokens_per_s_before_after"]
        out.print(
            f"indexing: {indexing['tokens']} tokens in {indexing['seconds']:.0f} s = {indexing['tokens_per_s']:.0f} tok/s, "
            f"{indexing['fraction_of_forward']:.2f} of the plain forward ({indexing['forward_tokens_per_s']:.0f} tok/s, "
            f"the mean of {before:.0f} before and {after:.0f} after indexing)"
        )
    out.print((result.out_dir / "results.md").read_text(encoding="utf-8"), markup=False, highlight=False)
