"""`rag-kvcache ask` and `chat`: questions answered over an index with fused KV caches."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..config import FusionConfig, GenerationConfig, QueryConfig, StorageConfig
from .common import base_config, check_method, err, fail, model_process, out, placed
from .options import (
    INDEX_HELP,
    ChunkOrderName,
    DeviationName,
    KVBudget,
    KVRemote,
    PlacedDevice,
    PlacedDType,
    default,
    fields_of,
    option,
    parse_ratio,
)


def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    method: Annotated[str, option(FusionConfig, "method")] = default(FusionConfig, "method"),
    top_k: Annotated[int, option(QueryConfig, "top_k", min=1)] = default(QueryConfig, "top_k"),
    chunk_order: Annotated[ChunkOrderName, option(QueryConfig, "chunk_order")] = ChunkOrderName(
        default(QueryConfig, "chunk_order")
    ),
    ratio: Annotated[str, option(FusionConfig, "ratio")] = str(default(FusionConfig, "ratio")),
    check_layer: Annotated[int, option(FusionConfig, "check_layer", min=0)] = default(FusionConfig, "check_layer"),
    filter_steps: Annotated[int, option(FusionConfig, "filter_steps", min=1)] = default(FusionConfig, "filter_steps"),
    deviation: Annotated[DeviationName, option(FusionConfig, "deviation")] = DeviationName(
        default(FusionConfig, "deviation")
    ),
    epic_k: Annotated[int | None, option(FusionConfig, "epic_k", min=0)] = default(FusionConfig, "epic_k"),
    match_words: Annotated[int, option(FusionConfig, "match_words", min=1)] = default(FusionConfig, "match_words"),
    max_new_tokens: Annotated[int, option(GenerationConfig, "max_new_tokens", min=1)] = default(
        GenerationConfig, "max_new_tokens"
    ),
    temperature: Annotated[float, option(GenerationConfig, "temperature", min=0.0)] = default(
        GenerationConfig, "temperature"
    ),
    top_p: Annotated[float, option(GenerationConfig, "top_p", min=0.0, max=1.0)] = default(GenerationConfig, "top_p"),
    seed: Annotated[Optional[int], option(GenerationConfig, "seed")] = default(GenerationConfig, "seed"),
    stop: Annotated[Optional[list[str]], option(GenerationConfig, "stop")] = None,
    json_schema: Annotated[Optional[str], option(GenerationConfig, "json_schema", metavar="FILE_OR_JSON")] = None,
    draft_tokens: Annotated[int, option(GenerationConfig, "draft_tokens", min=0)] = default(
        GenerationConfig, "draft_tokens"
    ),
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Use this model instead of the index's (same weights only: another model misses every cache)."
        ),
    ] = None,
    kv_remote: KVRemote = None,
    kv_budget: KVBudget = None,
    device: PlacedDevice = None,
    dtype: PlacedDType = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the answer as one JSON object.")] = False,
    stream: Annotated[
        bool,
        typer.Option(
            help="Print the text as it is generated; with --json, one JSON line "
            '{"text": ...} per piece, then the answer object.'
        ),
    ] = False,
) -> None:
    """Answer QUESTION from the index, fusing the retrieved chunks' KV caches."""
    params = dict(locals())
    from ..index import KVIndex
    from ..query.generator import FusedGenerator
    from ..store.controller import resolve_ratio

    model_process()
    if not question.strip():
        fail("the question is empty")
    if "" in (stop or ()):
        fail(f"--stop must not be empty (it would end every answer before its first token), got {stop!r}")
    schema = _json_schema(json_schema)
    try:
        check_method(method)
        meta_cfg = KVIndex.config_of(index_dir, base_config())
        cfg = meta_cfg.with_index(model=model or meta_cfg.index.model)
        cfg = placed(cfg.with_query(top_k=top_k, chunk_order=chunk_order.value), device, dtype)
        cfg = cfg.with_fusion(**fields_of(FusionConfig, params, ratio=parse_ratio(ratio)))
        cfg = cfg.with_generation(**fields_of(GenerationConfig, params, stop=tuple(stop or ()), json_schema=schema))
        idx = KVIndex.open(index_dir, cfg.with_storage(remote=kv_remote, disk_bytes=kv_budget))
        cfg, decision = resolve_ratio(cfg, idx.adapter)
        if decision is not None:
            err.print(f"[dim]loading controller: {decision.explain()}[/dim]", highlight=False)
        on_text = None
        if stream:
            on_text = (
                (lambda t: print(json.dumps({"text": t}), flush=True))
                if as_json
                else (lambda t: out.print(t, end="", highlight=False, markup=False))
            )
        answer = FusedGenerator(idx).ask(
            question, top_k=top_k, fusion=cfg.query.fusion, generation=cfg.query.generation, on_text=on_text
        )
    except (OSError, ValueError) as e:  # OSError: a read-only or full index that cannot be read (named)
        fail(str(e))
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
        f"sources: {', '.join(sorted({c.source for c in answer.chunks}))}[/dim]",
        highlight=False,
    )


def chat(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    method: Annotated[str, option(FusionConfig, "method")] = default(FusionConfig, "method"),
    top_k: Annotated[int, option(QueryConfig, "top_k", min=1)] = default(QueryConfig, "top_k"),
    chunk_order: Annotated[ChunkOrderName, option(QueryConfig, "chunk_order")] = ChunkOrderName(
        default(QueryConfig, "chunk_order")
    ),
    max_new_tokens: Annotated[int, option(GenerationConfig, "max_new_tokens", min=1)] = default(
        GenerationConfig, "max_new_tokens"
    ),
    conversation_bytes: Annotated[int, option(StorageConfig, "conversation_bytes", min=0)] = default(
        StorageConfig, "conversation_bytes"
    ),
    kv_remote: KVRemote = None,
    kv_budget: KVBudget = None,
    device: PlacedDevice = None,
    dtype: PlacedDType = None,
) -> None:
    """Chat over the index, one message per line of standard input (an empty line is skipped; end of input
    ends the chat). Each message gets the chunks retrieved for it that the chat does not hold yet; they stay in
    the conversation, and each turn reads the turns before it from the conversation cache, so only the new
    message and its new chunks are computed. A chat that outgrows the model's context drops its oldest half."""
    from ..engine.prompt import ChatTurn, ChunkPart
    from ..index import KVIndex
    from ..query.answers import Answer
    from ..query.generator import FusedGenerator
    from ..store.conversations import ConversationCache

    model_process()
    try:
        check_method(method)
        cfg = placed(KVIndex.config_of(index_dir, base_config()), device, dtype).with_fusion(method=method)
        cfg = cfg.with_query(chunk_order=chunk_order.value)
        cfg = cfg.with_generation(max_new_tokens=max_new_tokens).with_storage(remote=kv_remote, disk_bytes=kv_budget)
        idx = KVIndex.open(index_dir, cfg)
    except (OSError, ValueError) as e:
        fail(str(e))
    generator = FusedGenerator(idx, ConversationCache(conversation_bytes) if conversation_bytes else None)
    limit = idx.adapter.context_length - max_new_tokens
    turns: list[ChatTurn] = []
    for line in sys.stdin:
        if not (message := line.strip()):
            continue
        try:
            held = {part.label for turn in turns for part in turn.parts if isinstance(part, ChunkPart)}
            hits = [
                h for h in cfg.query.in_prompt_order(idx.search(message, top_k)) if f"chunk:{h.chunk.id}" not in held
            ]
            chunks = tuple(ChunkPart(h.chunk.token_ids, f"chunk:{h.chunk.id}") for h in hits)
            turns.append(ChatTurn("user", (*chunks, message)))
            segments, dropped = generator.fit.fitted(turns, (), cfg.query.fusion, limit)
            turns = turns[dropped:]
            pieces: list[str] = []
            for step in generator.stream(segments, cfg.query.fusion, cfg.query.generation):
                if isinstance(step, Answer):
                    answer = step
                else:
                    pieces.append(step)
                    out.print(step, end="", highlight=False, markup=False)
        except (OSError, ValueError) as e:
            fail(str(e))
        turns.append(ChatTurn("assistant", ("".join(pieces).strip(),)))
        out.print()
        out.print(
            f"[dim]{answer.method}: ttft {answer.ttft_s * 1000:.0f} ms, {answer.prompt_tokens} prompt tokens, "
            f"{answer.cached_tokens} from cache ({answer.conversation_tokens} of the conversation), {len(hits)} new "
            f"chunk(s){f', {dropped} oldest messages dropped' if dropped else ''}[/dim]",
            highlight=False,
        )


def _json_schema(value: str | None) -> str | None:
    """`--json-schema`'s JSON text: the value itself when it begins with `{`, else the file it names. The
    [structured] extra is checked here, before a model loads; the schema itself when decoding starts."""
    if value is None:
        return None
    if importlib.util.find_spec("llguidance") is None:
        fail("--json-schema needs llguidance: pip install 'rag-kvcache[structured]'")
    if value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--json-schema takes JSON text (beginning with '{{') or a file; {value!r} is neither: {e}")
