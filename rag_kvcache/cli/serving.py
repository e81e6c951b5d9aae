"""`rag-kvcache serve`: the OpenAI-compatible server over an index."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..config import (
    FusionConfig,
    GenerationConfig,
    QueryConfig,
    StorageConfig,
)
from ..serving.settings import ServerConfig
from .common import base_config, err, fail, model_process, placed
from .options import (
    INDEX_HELP,
    ChunkOrderName,
    History,
    KVBudget,
    KVOnDevice,
    KVRemote,
    KVRemoteWritable,
    Order,
    PlacedDevice,
    PlacedDType,
    default,
    fields_of,
    option,
)


def serve(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    host: Annotated[str, option(ServerConfig, "host")] = default(ServerConfig, "host"),
    port: Annotated[int, option(ServerConfig, "port", min=0, max=65535)] = default(ServerConfig, "port"),
    api_key: Annotated[Optional[list[str]], option(ServerConfig, "api_keys", envvar="RAG_KVCACHE_API_KEY")] = None,
    admin_key: Annotated[
        Optional[list[str]], option(ServerConfig, "admin_keys", "--admin-key", envvar="RAG_KVCACHE_ADMIN_KEY")
    ] = None,
    docs: Annotated[Optional[Path], option(ServerConfig, "docs_dir")] = None,
    max_queue: Annotated[int, option(ServerConfig, "max_queue", min=0)] = default(ServerConfig, "max_queue"),
    max_batch: Annotated[int, option(ServerConfig, "max_batch", min=1)] = default(ServerConfig, "max_batch"),
    max_prompt_tokens: Annotated[int, option(ServerConfig, "max_prompt_tokens", min=1)] = default(
        ServerConfig, "max_prompt_tokens"
    ),
    max_tokens: Annotated[int, option(ServerConfig, "max_tokens", min=1)] = default(ServerConfig, "max_tokens"),
    max_body_bytes: Annotated[int, option(ServerConfig, "max_body_bytes", min=1)] = default(
        ServerConfig, "max_body_bytes"
    ),
    max_per_key: Annotated[int, option(ServerConfig, "max_per_key", min=0)] = default(ServerConfig, "max_per_key"),
    order: Annotated[Order, option(ServerConfig, "order")] = Order(default(ServerConfig, "order")),
    history: Annotated[History, option(ServerConfig, "history")] = History(default(ServerConfig, "history")),
    top_k: Annotated[Optional[int], option(ServerConfig, "top_k", "--top-k", min=1, max=64)] = None,
    backfill_slice_s: Annotated[float, option(ServerConfig, "backfill_slice_s", "--backfill-slice", min=0)] = (
        default(ServerConfig, "backfill_slice_s")
    ),
    kv_remote: KVRemote = None,
    kv_remote_writable: KVRemoteWritable = default(StorageConfig, "remote_writable"),
    kv_budget: KVBudget = None,
    kv_on_device: KVOnDevice = default(StorageConfig, "memory_on_device"),
    device: PlacedDevice = None,
    dtype: PlacedDType = None,
    template_text: Annotated[
        bool, option(FusionConfig, "template_text", "--template-text/--no-template-text")
    ] = default(FusionConfig, "template_text"),
    conversation_bytes: Annotated[int, option(StorageConfig, "conversation_bytes", min=0)] = default(
        StorageConfig, "conversation_bytes"
    ),
    request_bytes: Annotated[int, option(StorageConfig, "request_bytes", min=0)] = default(
        StorageConfig, "request_bytes"
    ),
    memory_bytes: Annotated[int, option(StorageConfig, "memory_bytes", min=0)] = default(StorageConfig, "memory_bytes"),
    prefetch: Annotated[Optional[bool], option(ServerConfig, "prefetch", "--prefetch/--no-prefetch")] = default(
        ServerConfig, "prefetch"
    ),
    draft_tokens: Annotated[int, option(GenerationConfig, "draft_tokens", min=0)] = default(
        GenerationConfig, "draft_tokens"
    ),
    chunk_order: Annotated[ChunkOrderName, option(QueryConfig, "chunk_order")] = ChunkOrderName(
        default(QueryConfig, "chunk_order")
    ),
) -> None:
    """Serve the index over an OpenAI-compatible HTTP API (chat/completions, completions, models,
    retrieve, documents, metrics, health), the model loaded once."""
    params = dict(locals())
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        fail(f"`rag-kvcache serve` needs {', '.join(missing)}: pip install 'rag-kvcache[serve]'")
    from ..index import KVIndex
    from ..serving.engine import ServingEngine
    from ..serving.openai_api import serve as run_server

    model_process()
    try:
        keys = {"api_keys": tuple(api_key or ()), "admin_keys": tuple(admin_key or ())}
        server_cfg = ServerConfig(**fields_of(ServerConfig, params, docs_dir=docs, **keys))
        cfg = (
            placed(KVIndex.config_of(index_dir, base_config()), device, dtype)
            .with_fusion(template_text=template_text)
            .with_generation(draft_tokens=draft_tokens)
            .with_query(chunk_order=chunk_order.value)
        )
        engine = ServingEngine(
            index_dir,
            cfg.with_storage(
                **fields_of(
                    StorageConfig, params, remote=kv_remote, disk_bytes=kv_budget, memory_on_device=kv_on_device
                ),
                remote_writable=kv_remote_writable,
            ),
        )
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    if host not in ("127.0.0.1", "localhost", "::1") and not server_cfg.authenticates:
        err.print(
            f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who reaches it can use it "
            "and change its documents",
            highlight=False,
        )
    storage = engine.index.config.runtime.storage
    err.print(f"serving {index_dir} ({cfg.index.model}) on http://{host}:{port}/v1", highlight=False)
    ahead = "on" if server_cfg.prefetches(storage) else "off"
    err.print(
        f"order {server_cfg.order}; prefetch {ahead} (remote tier: {storage.remote_address or 'none'})", highlight=False
    )
    if server_cfg.top_k is not None:
        err.print(
            f"a chat naming no chunks of its own is fused with the top {server_cfg.top_k} retrieved", highlight=False
        )
    err.print(engine.index.store.trust(), highlight=False)
    with engine:
        run_server(engine, server_cfg)
