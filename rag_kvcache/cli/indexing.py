"""`rag-kvcache index`: a folder of documents into an index (chunks, embeddings, KV caches)."""

from __future__ import annotations

import os
import shutil
from typing import Annotated, Optional

import typer
from rich.filesize import decimal

from ..config import IndexSettings, RuntimeConfig, StorageConfig
from .common import base_config, err, fail, model_process, out, path_arg, was_given
from .options import (
    ChunkPrefillName,
    DType,
    EmbedderDType,
    KVBudget,
    KVCodec,
    KVRemote,
    KVRemoteWritable,
    default,
    fields_of,
    option,
)

PASSES_NICENESS = 19  # the cache passes' CPU priority once the folder is searchable: the lowest


def yield_cpu() -> None:
    """Run the rest of `index` (the cache passes, once the folder is searchable) at the lowest CPU priority, so a
    question asked meanwhile (`ask`, `serve`: the chunks it needs computed in the request) is answered as on an
    idle machine instead of sharing the cores with the passes. Priority orders the processes of one session (a
    terminal, a service) on Linux with autogroup scheduling; where the OS has no `nice`, nothing changes."""
    if hasattr(os, "nice"):
        os.nice(PASSES_NICENESS - os.nice(0))


def index(
    ctx: typer.Context,
    docs_arg: Annotated[str, typer.Argument(metavar="DOCS_DIR", help="Folder of text documents.")],
    index_arg: Annotated[str, typer.Option("--index", help="Where the index and KV caches go.")],
    chunk_tokens: Annotated[int, option(IndexSettings, "chunk_tokens", min=16)] = default(
        IndexSettings, "chunk_tokens"
    ),
    model: Annotated[str, option(IndexSettings, "model")] = default(IndexSettings, "model"),
    embedder: Annotated[str, option(IndexSettings, "embedder")] = default(IndexSettings, "embedder"),
    hnsw: Annotated[bool, typer.Option(help="HNSW instead of exact search (large corpora).")] = False,
    chunk_prefill: Annotated[ChunkPrefillName, option(IndexSettings, "chunk_prefill")] = ChunkPrefillName(
        default(IndexSettings, "chunk_prefill")
    ),
    context_chunks: Annotated[int, option(IndexSettings, "context_chunks", min=1)] = default(
        IndexSettings, "context_chunks"
    ),
    kv_codec: Annotated[KVCodec, option(IndexSettings, "codec")] = KVCodec(default(IndexSettings, "codec")),
    prune: Annotated[
        bool,
        typer.Option(
            help="Also drop the documents the index holds that are not in DOCS_DIR "
            "(deleted files, other folders', added through a store)."
        ),
    ] = False,
    max_file_bytes: Annotated[int, option(RuntimeConfig, "max_file_bytes", min=1)] = default(
        RuntimeConfig, "max_file_bytes"
    ),
    max_documents: Annotated[int, option(RuntimeConfig, "max_documents", min=1)] = default(
        RuntimeConfig, "max_documents"
    ),
    kv_remote: KVRemote = None,
    kv_remote_writable: KVRemoteWritable = default(StorageConfig, "remote_writable"),
    kv_budget: KVBudget = None,
    ray: Annotated[Optional[str], option(RuntimeConfig, "ray")] = None,
    ray_workers: Annotated[int, option(RuntimeConfig, "ray_workers", min=0)] = default(RuntimeConfig, "ray_workers"),
    device: Annotated[str, option(RuntimeConfig, "device")] = default(RuntimeConfig, "device"),
    dtype: Annotated[DType, option(IndexSettings, "dtype")] = DType(default(IndexSettings, "dtype")),
    embedder_dtype: Annotated[EmbedderDType, option(RuntimeConfig, "embedder_dtype")] = EmbedderDType(
        default(RuntimeConfig, "embedder_dtype")
    ),
) -> None:
    """Chunk, embed and precompute KV caches for every file in DOCS_DIR, adding them to the index.

    Incremental on re-runs: unchanged files are skipped, changed ones redone. Documents from other
    folders (or deleted files) stay in the index unless --prune drops them.
    Re-indexing into an existing index keeps the settings it was built with.
    """
    params = dict(locals())
    from ..index import KVIndex
    from ..retrieval import database

    docs_dir, index_dir = path_arg(docs_arg, "DOCS_DIR"), path_arg(index_arg, "--index")
    if not docs_dir.is_dir():
        fail(f"documents folder not found or not a folder: {docs_dir}")
    model_process()
    new_index = not index_dir.exists()
    idx = None
    given = {
        name: value
        for name, value in [
            ("chunk_tokens", chunk_tokens),
            ("model", model),
            ("embedder", embedder),
            ("chunk_prefill", chunk_prefill.value),
            ("context_chunks", context_chunks),
            ("dtype", dtype.value),
        ]
        if was_given(ctx, name)
    }
    given |= {"index_type": "hnsw"} if hnsw else {}
    given |= {"codec": kv_codec.value} if was_given(ctx, "kv_codec") else {}
    try:
        if database.exists(index_dir):  # not an index.sqlite without tables (a killed creation): that is replaced
            cfg = KVIndex.config_of(index_dir, base_config())
            for key, value in given.items():
                if value != getattr(cfg.index, key):
                    fail(
                        f"{index_dir} was built with {key}={getattr(cfg.index, key)!r}, not {value!r}: use a new --index"
                    )
        else:
            cfg = base_config().with_index(**given)  # --kv-codec's default is IndexSettings.codec's
        cfg = cfg.with_runtime(**fields_of(RuntimeConfig, params))
        idx = KVIndex.create(
            index_dir, cfg.with_storage(remote=kv_remote, remote_writable=kv_remote_writable, disk_bytes=kv_budget)
        )
        err.print(idx.store.trust(), highlight=False)
        if ray is None:
            report = idx.update(docs_dir, prune=prune, on_searchable=yield_cpu)
        else:
            with idx.ray_workers() as workers:
                report = idx.update(docs_dir, prune=prune, workers=workers, on_searchable=yield_cpu)
    except KeyboardInterrupt:
        kept = 0 if idx is None else idx.maker.made
        err.print(
            f"interrupted: {index_dir} keeps the chunks this run committed (searchable) and the {kept} KV caches "
            "it computed; running the same command again resumes with the caches still to make",
            highlight=False,
        )
        raise typer.Exit(130) from None
    except (OSError, ValueError) as e:  # OSError: missing folders, a full disk (StorageFullError)
        if new_index and index_dir.is_dir():  # made by this command: leave nothing of a failed first run behind
            shutil.rmtree(index_dir)
        fail(str(e))
    whole = decimal(idx.kv_bytes(map(len, idx.chunks.token_ids())))
    held = None if idx.store.ledger is None else idx.store.ledger.stats(0)  # the budget and the bytes, one read
    caches = (
        f"KV caches {whole}"
        if held is None or held.budget is None
        else f"KV caches {decimal(held.bytes)} on disk within the budget of {decimal(held.budget)} "
        f"(every chunk's would take {whole})"
    )
    out.print(
        f"indexed {docs_dir}: {len(report.added)} added, {len(report.changed)} changed, {len(report.removed)} removed, "
        f"{len(report.unchanged)} unchanged, {len(report.skipped)} skipped; {len(idx.chunks)} chunks; "
        f"{caches} ({idx.store.codec.name}, {idx.kv_bytes_per_token / 1024:.1f} KiB/token)",
        highlight=False,
    )
