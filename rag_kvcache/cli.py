"""`rag-kvcache`: index a folder, ask with fused KV, run the demo. The only place that prints or reads
environment variables (`RAG_KVCACHE_CACHE_DIR`: where converted models live; `RAG_KVCACHE_KV_REMOTE_SECRET`: the
key that authenticates the remote tier's entries).

Options that set a `Config` field take their default and help from the field (`config.setting`), so
config.py is the one source of both. torch, transformers and FAISS are imported inside the commands
that need them: `--help` and `--version` stay fast.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import shutil
import statistics
import sys
from dataclasses import asdict, replace
from enum import Enum
from importlib.resources import as_file, files
from pathlib import Path
from typing import Annotated, Any, Optional, get_args, get_type_hints

import typer
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Table

from .bench.datasets import FORMATS
from .bench.prompts import PROMPT_STYLES
from .config import (
    CHUNK_PREFILLS,
    CODEC_NAMES,
    Config,
    Deviation,
    FusionConfig,
    GenerationConfig,
    StorageConfig,
)
from .serving.settings import ServerConfig
from .version import __version__

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="RAG that never prefills the same chunk twice.",
)
out = Console()
err = Console(stderr=True)

DEMO_QUESTION = "What is the name of the main telescope of the Veldmark Observatory?"
INDEX_HELP = "An index built by `rag-kvcache index`."

KVCodec = Enum("KVCodec", {name: name for name in CODEC_NAMES}, type=str)
DeviationName = Enum("DeviationName", {name: name for name in get_args(Deviation)}, type=str)
DatasetFormat = Enum("DatasetFormat", {name: name for name in FORMATS}, type=str)
PromptStyle = Enum("PromptStyle", {name: name for name in PROMPT_STYLES}, type=str)
DType = Enum("DType", {name: name for name in get_args(get_type_hints(Config)["dtype"])}, type=str)
ChunkPrefillName = Enum("ChunkPrefillName", {name: name for name in CHUNK_PREFILLS}, type=str)
Order = Enum("Order", {name: name for name in get_args(get_type_hints(ServerConfig)["order"])}, type=str)
History = Enum("History", {name: name for name in get_args(get_type_hints(ServerConfig)["history"])}, type=str)
BENCH_METHODS = "full,prefix,reuse,cacheblend,epic"  # bench.runner.DEFAULT_METHODS (a test keeps them equal)


def default(cls: type, name: str) -> Any:
    """The default of config field `cls.name`."""
    return cls.__dataclass_fields__[name].default


def option(cls: type, name: str, *decls: str, **kwargs: Any) -> Any:
    """A typer option for config field `cls.name`, with the field's help text."""
    return typer.Option(*decls, help=cls.__dataclass_fields__[name].metadata["help"], **kwargs)


KVRemote = Annotated[Optional[str], option(StorageConfig, "remote", "--kv-remote")]


def _base_config(**changes: object) -> Config:
    cache_dir = os.environ.get("RAG_KVCACHE_CACHE_DIR")
    cfg = Config(**({"cache_dir": Path(cache_dir)} if cache_dir else {}))
    if secret := os.environ.get("RAG_KVCACHE_KV_REMOTE_SECRET"):
        cfg = cfg.with_storage(remote_secret=secret.encode())
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})


def _placed(cfg: Config, device: str | None, dtype: DType | None) -> Config:
    """`cfg` with the `--device` and `--dtype` given (each left as it is when not given)."""
    return replace(cfg, **{k: v for k, v in (("device", device), ("dtype", dtype and dtype.value)) if v is not None})


def _model_process() -> None:
    """Process-wide settings of a command that loads a model (this CLI is their edge; the library sets none):
    transformers' weight-loading bars hidden (noise here), and PyTorch's cuDNN attention off. On CUDA,
    SDPA otherwise picks cuDNN's kernel, which builds a plan for every new sequence length, so every prompt
    and every decoding step of a new length pays it: on an H100 (1.1B Llama, side by side over 8 new
    lengths of 2,000-3,100 tokens, benchmarks/gpu/sdpa_backends.py) a full prefill took 100 ms with it and
    22 ms without, a decoding step 82 and 18 ms. Flash and memory-efficient attention stay; no effect on CPU."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.backends.cuda.enable_cudnn_sdp(False)


def _show_version(value: bool) -> None:
    if value:
        out.print(f"rag-kvcache {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )
    logging.getLogger("rag_kvcache").setLevel(logging.DEBUG if verbose else logging.INFO)


def _path(value: str, name: str) -> Path:
    """A path argument, refused when empty (an empty string would mean the current directory)."""
    if not value.strip():
        _fail(f"{name} is empty: name a folder (use '.' for the current one)")
    return Path(value)


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)  # escaped: "rag-kvcache[serve]" is no markup
    raise typer.Exit(2)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was set by the user rather than left at its default."""
    # By name: typer >= 0.29 runs on its own copy of click, whose ParameterSource is not click's.
    return ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP")


def _ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--ratio must be a number in [0, 1] or 'auto', got {text!r}") from None


def _check_method(name: str) -> None:
    """Refuse a method the registry does not know (read now, so methods registered after import count)."""
    from .engine.methods import METHODS

    if name not in METHODS:
        raise ValueError(f"unknown fusion method {name!r}; registered: {', '.join(METHODS)}")


@app.command()
def index(
    ctx: typer.Context,
    docs_arg: Annotated[str, typer.Argument(metavar="DOCS_DIR", help="Folder of text documents.")],
    index_arg: Annotated[str, typer.Option("--index", help="Where the index and KV caches go.")],
    chunk_tokens: Annotated[int, option(Config, "chunk_tokens", min=16)] = default(Config, "chunk_tokens"),
    model: Annotated[str, option(Config, "model")] = default(Config, "model"),
    embedder: Annotated[str, option(Config, "embedder")] = default(Config, "embedder"),
    hnsw: Annotated[bool, typer.Option(help="HNSW instead of exact search (large corpora).")] = False,
    chunk_prefill: Annotated[ChunkPrefillName, option(Config, "chunk_prefill")] = ChunkPrefillName(
        default(Config, "chunk_prefill")),
    context_chunks: Annotated[int, option(Config, "context_chunks", min=1)] = default(Config, "context_chunks"),
    kv_codec: Annotated[KVCodec, option(StorageConfig, "codec")] = KVCodec(default(StorageConfig, "codec")),
    prune: Annotated[bool, typer.Option(help="Also drop the documents the index holds that are not in DOCS_DIR "
                                             "(deleted files, other folders', added through a store).")] = False,
    max_file_bytes: Annotated[int, option(Config, "max_file_bytes", min=1)] = default(Config, "max_file_bytes"),
    max_documents: Annotated[int, option(Config, "max_documents", min=1)] = default(Config, "max_documents"),
    kv_remote: KVRemote = None,
    ray: Annotated[Optional[str], option(Config, "ray")] = None,
    ray_workers: Annotated[int, option(Config, "ray_workers", min=0)] = default(Config, "ray_workers"),
    device: Annotated[str, option(Config, "device")] = default(Config, "device"),
    dtype: Annotated[DType, option(Config, "dtype")] = DType(default(Config, "dtype")),
) -> None:
    """Chunk, embed and precompute KV caches for every file in DOCS_DIR, adding them to the index.

    Incremental on re-runs: unchanged files are skipped, changed ones redone. Documents from other
    folders (or deleted files) stay in the index unless --prune drops them.
    Re-indexing into an existing index keeps the settings it was built with.
    """
    from .index import KVIndex
    from .retrieval import database

    docs_dir, index_dir = _path(docs_arg, "DOCS_DIR"), _path(index_arg, "--index")
    if not docs_dir.is_dir():
        _fail(f"documents folder not found or not a folder: {docs_dir}")
    _model_process()
    new_index = not index_dir.exists()
    idx = None
    given = {name: value for name, value in [("chunk_tokens", chunk_tokens), ("model", model), ("embedder", embedder),
                                             ("chunk_prefill", chunk_prefill.value), ("context_chunks", context_chunks),
                                             ("dtype", dtype.value)] if _given(ctx, name)}
    given |= {"index_type": "hnsw"} if hnsw else {}
    try:
        if database.exists(index_dir):  # not an index.sqlite without tables (a killed creation): that is replaced
            cfg = KVIndex.config_of(index_dir, _base_config())
            for key, value in given.items():
                if value != getattr(cfg, key):
                    _fail(f"{index_dir} was built with {key}={getattr(cfg, key)!r}, not {value!r}: use a new --index")
            if _given(ctx, "kv_codec") and kv_codec.value != cfg.storage.codec:
                _fail(f"{index_dir} stores KV caches as {cfg.storage.codec!r}, not {kv_codec.value!r}: use a new --index")
        else:
            cfg = _base_config(**given).with_storage(codec=kv_codec.value)
        cfg = replace(cfg, max_file_bytes=max_file_bytes, max_documents=max_documents, device=device)  # not recorded
        idx = KVIndex.create(index_dir, replace(cfg, ray=ray, ray_workers=ray_workers).with_storage(remote=kv_remote))
        if ray is None:
            report = idx.update(docs_dir, prune=prune)
        else:
            from .indexing.cluster import RayWorkers

            with RayWorkers(idx) as workers:
                report = idx.update(docs_dir, prune=prune, workers=workers)
    except KeyboardInterrupt:
        kept = 0 if idx is None else sum(key in idx.store.disk for key in idx.pending())
        err.print(f"interrupted: {index_dir} holds what it held before this run; the {kept} KV caches this run "
                  "computed are kept, and running the same command again resumes with them", highlight=False)
        raise typer.Exit(130) from None
    except (OSError, ValueError) as e:  # OSError: missing folders, a full disk (StorageFullError)
        if new_index and index_dir.is_dir():  # made by this command: leave nothing of a failed first run behind
            shutil.rmtree(index_dir)
        _fail(str(e))
    out.print(
        f"indexed {docs_dir}: {len(report.added)} added, {len(report.changed)} changed, {len(report.removed)} removed, "
        f"{len(report.unchanged)} unchanged, {len(report.skipped)} skipped; {len(idx.chunks)} chunks; "
        f"KV caches {decimal(idx.kv_bytes(map(len, idx.chunks.token_ids())))} "
        f"({idx.store.codec.name}, {idx.kv_bytes_per_token / 1024:.1f} KiB/token)", highlight=False,
    )


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    method: Annotated[str, option(FusionConfig, "method")] = default(FusionConfig, "method"),
    top_k: Annotated[int, option(Config, "top_k", min=1)] = default(Config, "top_k"),
    ratio: Annotated[str, option(FusionConfig, "ratio")] = str(default(FusionConfig, "ratio")),
    check_layer: Annotated[int, option(FusionConfig, "check_layer", min=0)] = default(FusionConfig, "check_layer"),
    filter_steps: Annotated[int, option(FusionConfig, "filter_steps", min=1)] = default(FusionConfig, "filter_steps"),
    deviation: Annotated[DeviationName, option(FusionConfig, "deviation")] = DeviationName(default(FusionConfig, "deviation")),
    epic_k: Annotated[int, option(FusionConfig, "epic_k", min=0)] = default(FusionConfig, "epic_k"),
    match_words: Annotated[int, option(FusionConfig, "match_words", min=1)] = default(FusionConfig, "match_words"),
    max_new_tokens: Annotated[int, option(GenerationConfig, "max_new_tokens", min=1)] = default(GenerationConfig, "max_new_tokens"),
    temperature: Annotated[float, option(GenerationConfig, "temperature", min=0.0)] = default(GenerationConfig, "temperature"),
    top_p: Annotated[float, option(GenerationConfig, "top_p", min=0.0, max=1.0)] = default(GenerationConfig, "top_p"),
    seed: Annotated[Optional[int], option(GenerationConfig, "seed")] = default(GenerationConfig, "seed"),
    stop: Annotated[Optional[list[str]], option(GenerationConfig, "stop")] = None,
    json_schema: Annotated[Optional[str], option(GenerationConfig, "json_schema", metavar="FILE_OR_JSON")] = None,
    model: Annotated[Optional[str], typer.Option(help="Use this model instead of the index's (same weights only: "
                                                 "another model misses every cache).")] = None,
    kv_remote: KVRemote = None,
    device: Annotated[Optional[str], option(Config, "device")] = None,
    dtype: Annotated[Optional[DType], option(Config, "dtype")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the answer as one JSON object.")] = False,
    stream: Annotated[bool, typer.Option(help="Print the text as it is generated; with --json, one JSON line "
                                         "{\"text\": ...} per piece, then the answer object.")] = False,
) -> None:
    """Answer QUESTION from the index, fusing the retrieved chunks' KV caches."""
    from .generator import FusedGenerator
    from .index import KVIndex
    from .store.controller import resolve_ratio

    _model_process()
    if not question.strip():
        _fail("the question is empty")
    if "" in (stop or ()):
        _fail(f"--stop must not be empty (it would end every answer before its first token), got {stop!r}")
    schema = _json_schema(json_schema)
    try:
        _check_method(method)
        meta_cfg = KVIndex.config_of(index_dir, _base_config())
        cfg = _placed(replace(meta_cfg, model=model or meta_cfg.model, top_k=top_k), device, dtype)
        cfg = cfg.with_fusion(method=method, ratio=_ratio(ratio), check_layer=check_layer, filter_steps=filter_steps,
                              deviation=deviation.value, epic_k=epic_k, match_words=match_words)
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                  stop=tuple(stop or ()), json_schema=schema)
        idx = KVIndex.open(index_dir, cfg.with_storage(remote=kv_remote))
        cfg, decision = resolve_ratio(cfg, idx.adapter)
        if decision is not None:
            err.print(f"[dim]loading controller: {decision.explain()}[/dim]", highlight=False)
        on_text = None
        if stream:
            on_text = (lambda t: print(json.dumps({"text": t}), flush=True)) if as_json else (
                lambda t: out.print(t, end="", highlight=False, markup=False))
        answer = FusedGenerator(idx).ask(question, top_k=top_k, fusion=cfg.fusion, generation=cfg.generation,
                                         on_text=on_text)
    except (OSError, ValueError) as e:  # OSError: a read-only or full index that cannot be read (named)
        _fail(str(e))
    if as_json:
        result = answer.to_dict() | ({"controller": asdict(decision)} if decision is not None else {})
        print(json.dumps(result) if stream else json.dumps(result, indent=2))
        return
    if on_text is None:
        out.print(answer.answer, highlight=False, markup=False)
    else:
        out.print()
    out.print(
        f"[dim]{answer.method}: ttft {answer.ttft_s * 1000:.0f} ms, retrieval {answer.retrieval_s * 1000:.0f} ms, "
        f"{answer.prompt_tokens} prompt tokens, {answer.recomputed_tokens} recomputed, "
        f"sources: {', '.join(sorted({c.source for c in answer.chunks}))}[/dim]", highlight=False,
    )


@app.command()
def chat(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    method: Annotated[str, option(FusionConfig, "method")] = default(FusionConfig, "method"),
    top_k: Annotated[int, option(Config, "top_k", min=1)] = default(Config, "top_k"),
    max_new_tokens: Annotated[int, option(GenerationConfig, "max_new_tokens", min=1)] = default(GenerationConfig, "max_new_tokens"),
    conversation_bytes: Annotated[int, option(StorageConfig, "conversation_bytes", min=0)] = default(
        StorageConfig, "conversation_bytes"),
    kv_remote: KVRemote = None,
    device: Annotated[Optional[str], option(Config, "device")] = None,
    dtype: Annotated[Optional[DType], option(Config, "dtype")] = None,
) -> None:
    """Chat over the index, one message per line of standard input (an empty line is skipped; end of input
    ends the chat). Each message gets the chunks retrieved for it that the chat does not hold yet; they stay in
    the conversation, and each turn reads the turns before it from the conversation cache, so only the new
    message and its new chunks are computed. A chat that outgrows the model's context drops its oldest half."""
    from .engine.prompt import ChatTurn, ChunkPart
    from .generator import Answer, FusedGenerator
    from .index import KVIndex
    from .store.conversations import ConversationCache

    _model_process()
    try:
        _check_method(method)
        cfg = _placed(KVIndex.config_of(index_dir, _base_config()), device, dtype).with_fusion(method=method)
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens).with_storage(remote=kv_remote)
        idx = KVIndex.open(index_dir, cfg)
    except (OSError, ValueError) as e:
        _fail(str(e))
    generator = FusedGenerator(idx, ConversationCache(conversation_bytes) if conversation_bytes else None)
    limit = idx.adapter.context_length - max_new_tokens
    turns: list[ChatTurn] = []
    for line in sys.stdin:
        if not (message := line.strip()):
            continue
        try:
            held = {part.label for turn in turns for part in turn.parts if isinstance(part, ChunkPart)}
            hits = [h for h in idx.search(message, top_k) if f"chunk:{h.chunk.id}" not in held]
            chunks = tuple(ChunkPart(h.chunk.token_ids, f"chunk:{h.chunk.id}") for h in hits)
            turns.append(ChatTurn("user", (*chunks, message)))
            segments, dropped = generator.fitted_chat(turns, (), cfg.fusion, limit)
            turns = turns[dropped:]
            pieces: list[str] = []
            for step in generator.stream(segments, cfg.fusion, cfg.generation):
                if isinstance(step, Answer):
                    answer = step
                else:
                    pieces.append(step)
                    out.print(step, end="", highlight=False, markup=False)
        except (OSError, ValueError) as e:
            _fail(str(e))
        turns.append(ChatTurn("assistant", ("".join(pieces).strip(),)))
        out.print()
        out.print(
            f"[dim]{answer.method}: ttft {answer.ttft_s * 1000:.0f} ms, {answer.prompt_tokens} prompt tokens, "
            f"{answer.cached_tokens} from cache ({answer.conversation_tokens} of the conversation), {len(hits)} new "
            f"chunk(s){f', {dropped} oldest messages dropped' if dropped else ''}[/dim]", highlight=False,
        )


def _json_schema(value: str | None) -> str | None:
    """`--json-schema`'s JSON text: the value itself when it begins with `{`, else the file it names. The
    [structured] extra is checked here, before a model loads; the schema itself when decoding starts."""
    if value is None:
        return None
    if importlib.util.find_spec("llguidance") is None:
        _fail("--json-schema needs llguidance: pip install 'rag-kvcache[structured]'")
    if value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--json-schema takes JSON text (beginning with '{{') or a file; {value!r} is neither: {e}")


@app.command()
def stats(index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)], kv_remote: KVRemote = None) -> None:
    """Print the KV store's counters per tier (totals over every process that used it) and its size."""
    from .index import KVIndex
    from .store.kvstore import KVStore

    try:
        cfg = KVIndex.config_of(index_dir, _base_config()).with_storage(remote=kv_remote)
        store = KVStore(index_dir / "kv", cfg.storage)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    table = Table("tier", "hits", "misses", "hit rate", "read", "written", "evictions", "corrupt", "errors")
    for tier, s in store.stats().items():
        rate = f"{s.hits / (s.hits + s.misses):.1%}" if s.hits + s.misses else "-"
        table.add_row(
            tier, str(s.hits), str(s.misses), rate, _mib(s.bytes_read), _mib(s.bytes_written), str(s.evictions),
            str(s.corrupt), str(s.errors),
        )
    out.print(table)
    sizes = [p.stat().st_size for p in store.disk.files()]
    budget = "unbounded" if cfg.storage.disk_bytes is None else _mib(cfg.storage.disk_bytes)
    out.print(
        f"disk tier: {len(sizes)} entries, {_mib(sum(sizes))} (budget {budget}), codec {cfg.storage.codec}; "
        f"memory tier budget {_mib(cfg.storage.memory_bytes)} per process, eviction {cfg.storage.eviction}"
    )
    if store.remote is not None:
        _print_remote(store.remote)


def _print_remote(remote) -> None:
    """The remote tier's server figures (its whole database: other indexes' entries count too)."""
    import redis

    try:
        info = remote.server_info()
    except redis.RedisError as e:
        out.print(f"remote tier {remote.name}: does not answer ({type(e).__name__}: {e})", highlight=False)
        return
    limit = _mib(info["maxmemory"]) if info["maxmemory"] else "no limit"
    out.print(
        f"remote tier {remote.name}: {info['keys']} keys, {_mib(info['used_memory'])} used of {limit} "
        f"(maxmemory-policy {info['maxmemory_policy']}), {info['evicted_keys']} keys evicted by the server",
        highlight=False,
    )


@app.command()
def check(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    repair: Annotated[bool, typer.Option(help="Rebuild what can be rebuilt: vectors.faiss from the stored embeddings, "
                                         "damaged embeddings by re-embedding, missing or corrupt KV caches by "
                                         "recomputing; collect orphans. What is intact is not recomputed.")] = False,
) -> None:
    """Verify every file of an index: SQLite (integrity and every chunk row), vectors.faiss (checksum and ids)
    and every KV cache (every tensor's checksum). Exits 1 when something is wrong and not repaired."""
    from .index import KVIndex
    from .maintenance import check as check_index

    _model_process()
    try:
        index = KVIndex.open(index_dir, KVIndex.config_of(index_dir, _base_config()), rewrite=False)  # as it is
        report = check_index(index, repair=repair)
    except (OSError, ValueError) as e:
        _fail(str(e))
    for problem in report.problems:
        out.print(f"[red]found:[/red] {problem}", highlight=False)
    for garbage in report.garbage:
        out.print(f"[yellow]garbage:[/yellow] {garbage} (`rag-kvcache gc` deletes it)", highlight=False)
    for work in report.resumable:
        out.print(f"resumable: {work}", highlight=False)
    for done in report.repaired:
        out.print(f"[green]repaired:[/green] {done}", highlight=False)
    for left in report.unrepaired:
        out.print(f"[red]not repaired:[/red] {left}", highlight=False)
    out.print(
        f"{index_dir}: {'ok' if report.ok else 'damaged'}; {report.caches_checked} KV caches checked, "
        f"{report.reembedded} chunks re-embedded, {report.recomputed} KV caches recomputed", highlight=False,
    )
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def gc(index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)]) -> None:
    """Delete the KV caches no indexed chunk uses (of edited or deleted documents, of another model) and the
    temporary files of killed runs. `index` does this after every run too."""
    from .index import KVIndex
    from .maintenance import gc as collect

    _model_process()
    try:
        collected = collect(KVIndex.open(index_dir, KVIndex.config_of(index_dir, _base_config())))
    except (OSError, ValueError) as e:
        _fail(str(e))
    out.print(
        f"{index_dir}: deleted {collected.orphans} orphan KV caches ({_mib(collected.orphan_bytes)}) and "
        f"{collected.temp_files} temporary files", highlight=False,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@app.command()
def calibrate(
    index_dir: Annotated[Path, typer.Option("--index", help="Measure for this index's model, codec and disk.")],
    tokens: Annotated[int, typer.Option(min=16, help="Tokens per synthetic chunk cache.")] = 512,
    device: Annotated[Optional[str], option(Config, "device")] = None,
    dtype: Annotated[Optional[DType], option(Config, "dtype")] = None,
) -> None:
    """Measure tier read speeds and recompute time on this machine (once per model).

    Shows what the loading controller would choose (`ask --ratio auto` uses the measurement).
    """
    from .index import KVIndex
    from .store.controller import MEASURED_TIERS, choose_ratio, choose_tier
    from .store.controller import calibrate as measure

    _model_process()
    try:
        cfg = _placed(KVIndex.config_of(index_dir, _base_config()), device, dtype)
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
    device: Annotated[str, option(Config, "device")] = default(Config, "device"),
    dtype: Annotated[DType, option(Config, "dtype")] = DType(default(Config, "dtype")),
) -> None:
    """Index the bundled demo folder, then answer with `cacheblend` and compare its TTFT with `full`."""
    from .generator import FusedGenerator
    from .index import KVIndex

    _model_process()
    cfg = _base_config(chunk_tokens=128, top_k=4, device=device, dtype=dtype.value)
    with as_file(files("rag_kvcache") / "demo") as docs:
        out.print(f"[bold]Indexing[/bold] {docs} -> {index_dir}", highlight=False)
        idx = KVIndex.build(docs, index_dir, cfg)
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


@app.command()
def bench(
    dataset: Annotated[Path, typer.Option("--dataset", help="QA set: MuSiQue/CacheBlend JSON, LongBench or plain JSONL; "
                                          "planted:MUSIQUE_JSON plants a made-up fact in one passage per question.")],
    fmt: Annotated[Optional[DatasetFormat], typer.Option("--format", help="Dataset format (default: inferred from the file suffix).")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Use only the first N questions.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated fusion methods, or 'all' (every registered method); "
                                         "must include full. METHOD:PARAM=VALUE sets its parameter (epic:k=19, "
                                         "cacheblend:r=0.5); METHOD@CACHES runs METHOD on the caches of an index "
                                         "over the same corpus built with --chunk-prefill or --kv-codec CACHES, "
                                         "e.g. reuse@neighbours, cacheblend@none.")] = BENCH_METHODS,
    baseline: Annotated[str, typer.Option(help="Method the others' fidelity is compared with, question by question.")] = "cacheblend",
    chunk_tokens: Annotated[int, option(Config, "chunk_tokens", min=16)] = default(Config, "chunk_tokens"),
    top_k: Annotated[int, option(Config, "top_k", min=1)] = default(Config, "top_k"),
    chunk_prefill: Annotated[ChunkPrefillName, option(Config, "chunk_prefill")] = ChunkPrefillName(
        default(Config, "chunk_prefill")),
    context_chunks: Annotated[int, option(Config, "context_chunks", min=1)] = default(Config, "context_chunks"),
    ratio: Annotated[str, option(FusionConfig, "ratio")] = str(default(FusionConfig, "ratio")),
    check_layer: Annotated[int, option(FusionConfig, "check_layer", min=0)] = default(FusionConfig, "check_layer"),
    filter_steps: Annotated[int, option(FusionConfig, "filter_steps", min=1)] = default(FusionConfig, "filter_steps"),
    deviation: Annotated[DeviationName, option(FusionConfig, "deviation")] = DeviationName(default(FusionConfig, "deviation")),
    sweep: Annotated[bool, typer.Option(help="Also sweep CacheBlend ratios and EPIC k.")] = False,
    out_dir: Annotated[Path, typer.Option("--out", help="Results and the benchmark's index go here.")] = Path("bench-out"),
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Answer length cap (shorter than ask's: greedy answers "
                                                "are compared with full's).")] = 32,
    model: Annotated[str, option(Config, "model")] = default(Config, "model"),
    embedder: Annotated[str, option(Config, "embedder")] = default(Config, "embedder"),
    device: Annotated[str, option(Config, "device")] = default(Config, "device"),
    dtype: Annotated[DType, option(Config, "dtype")] = DType(default(Config, "dtype")),
    warmup: Annotated[int, typer.Option(min=0, help="Questions run untimed first.")] = 1,
    kv_codec: Annotated[KVCodec, option(StorageConfig, "codec")] = KVCodec(default(StorageConfig, "codec")),
    kv_remote: KVRemote = None,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 2,
    resume: Annotated[bool, typer.Option(help="Keep the questions an interrupted run in --out finished and "
                                         "measure the rest (same settings and machine only).")] = False,
    prompt_style: Annotated[PromptStyle, typer.Option(help="Prompt layout: native (our segments), langchain (the "
                                                      "RAG tutorial chain's prompt) or llamaindex (the default "
                                                      "text-QA template); chunks are found in it by their ids.")]
    = PromptStyle.native,
) -> None:
    """Compare fusion methods on a QA set: TTFT, speedup over full prefill, fidelity to full, F1.

    Indexes every passage of the set, then answers each question with every method. Fidelity is
    teacher-forced: full's greedy answer forced through each method's cache (KL per token, top-1
    agreement, log-probability change, first-token KL), with bootstrap CIs and a paired difference
    from --baseline; planted facts add the accuracy over the facts full answers. F1 is secondary.
    """
    missing = [name for name in ("matplotlib", "rouge_score") if importlib.util.find_spec(name) is None]
    if missing:
        _fail(f"`rag-kvcache bench` needs {', '.join(missing)}: pip install 'rag-kvcache[bench]'")
    from .bench.datasets import load_dataset
    from .bench.runner import BenchSettings, parse_methods, run_benchmark

    _model_process()
    try:
        examples = load_dataset(dataset, fmt and fmt.value, top_k=top_k)[:limit]
        settings = BenchSettings(
            methods=parse_methods(methods), baseline=baseline, sweep=sweep, warmup=warmup, threads=threads, resume=resume,
            prompt_style=prompt_style.value,
        )
        cfg = _base_config(chunk_tokens=chunk_tokens, top_k=top_k, model=model, embedder=embedder,
                           chunk_prefill=chunk_prefill.value, context_chunks=context_chunks, device=device,
                           dtype=dtype.value)
        cfg = cfg.with_fusion(ratio=_ratio(ratio), check_layer=check_layer, filter_steps=filter_steps,
                              deviation=deviation.value)
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens)  # greedy: every method decodes alike
        cfg = cfg.with_storage(remote=kv_remote, codec=kv_codec.value)
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


@app.command()
def serve(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    host: Annotated[str, option(ServerConfig, "host")] = default(ServerConfig, "host"),
    port: Annotated[int, option(ServerConfig, "port", min=0, max=65535)] = default(ServerConfig, "port"),
    api_key: Annotated[Optional[list[str]], option(ServerConfig, "api_keys", envvar="RAG_KVCACHE_API_KEY")] = None,
    docs: Annotated[Optional[Path], option(ServerConfig, "docs_dir")] = None,
    max_queue: Annotated[int, option(ServerConfig, "max_queue", min=0)] = default(ServerConfig, "max_queue"),
    max_batch: Annotated[int, option(ServerConfig, "max_batch", min=1)] = default(ServerConfig, "max_batch"),
    max_prompt_tokens: Annotated[int, option(ServerConfig, "max_prompt_tokens", min=1)] = default(
        ServerConfig, "max_prompt_tokens"),
    max_tokens: Annotated[int, option(ServerConfig, "max_tokens", min=1)] = default(ServerConfig, "max_tokens"),
    max_body_bytes: Annotated[int, option(ServerConfig, "max_body_bytes", min=1)] = default(
        ServerConfig, "max_body_bytes"),
    max_per_key: Annotated[int, option(ServerConfig, "max_per_key", min=0)] = default(ServerConfig, "max_per_key"),
    order: Annotated[Order, option(ServerConfig, "order")] = Order(default(ServerConfig, "order")),
    history: Annotated[History, option(ServerConfig, "history")] = History(default(ServerConfig, "history")),
    kv_remote: KVRemote = None,
    device: Annotated[Optional[str], option(Config, "device")] = None,
    dtype: Annotated[Optional[DType], option(Config, "dtype")] = None,
    template_text: Annotated[bool, option(FusionConfig, "template_text", "--template-text/--no-template-text")] = default(
        FusionConfig, "template_text"),
    conversation_bytes: Annotated[int, option(StorageConfig, "conversation_bytes", min=0)] = default(
        StorageConfig, "conversation_bytes"),
    request_bytes: Annotated[int, option(StorageConfig, "request_bytes", min=0)] = default(StorageConfig, "request_bytes"),
) -> None:
    """Serve the index over an OpenAI-compatible HTTP API (chat/completions, completions, models,
    retrieve, documents, metrics, health), the model loaded once."""
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        _fail(f"`rag-kvcache serve` needs {', '.join(missing)}: pip install 'rag-kvcache[serve]'")
    from .index import KVIndex
    from .serving.engine import Engine
    from .serving.openai_api import serve as run_server

    _model_process()
    try:
        server_cfg = ServerConfig(host=host, port=port, api_keys=tuple(api_key or ()), docs_dir=docs, max_queue=max_queue,
                                  max_batch=max_batch, max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens,
                                  max_body_bytes=max_body_bytes, max_per_key=max_per_key, order=order.value,
                                  history=history.value)
        cfg = _placed(KVIndex.config_of(index_dir, _base_config()), device, dtype).with_fusion(template_text=template_text)
        engine = Engine(index_dir, cfg.with_storage(remote=kv_remote, conversation_bytes=conversation_bytes,
                                                      request_bytes=request_bytes))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who reaches it can use it",
                  highlight=False)
    err.print(f"serving {index_dir} ({cfg.model}) on http://{host}:{port}/v1", highlight=False)
    with engine:
        run_server(engine, server_cfg)
