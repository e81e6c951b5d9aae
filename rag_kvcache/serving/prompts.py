"""A request's prompt: what a chat or completion request asks for (messages or a prompt, chunks named or
retrieved, sampling and fusion options) turned into the segments the generator fuses, on the engine's
thread; every refusal an `APIError` naming the parameter."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..answers import PromptTooLongError
from ..config import FusionConfig, GenerationConfig
from ..engine.generation import JsonSchemaConstraint
from ..engine.methods import METHODS
from ..engine.prompt import ChatTurn, Segment
from ..generator import FusedGenerator
from ..index import KVIndex
from ..retrieval.chunk_index import ChunkRecord
from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, Sampling
from .settings import ServerConfig


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as segments, the chunks fused into it, and how to fuse and decode."""

    segments: list[Segment]
    chunks: list[dict[str, Any]]  # id, source, score (None for chunks named by id)
    fusion: FusionConfig
    generation: GenerationConfig
    salt: str = ""  # the tenant (and the request's cache_salt) whose caches of request text it reads
    dropped: int = 0  # the chat's oldest messages left out to fit (`FusedGenerator.fitted_chat`)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


def _fusion(index: KVIndex, request: Sampling) -> FusionConfig:
    changes = request.rag_kvcache.fusion_changes()
    if "method" in changes and changes["method"] not in METHODS:
        raise APIError(400, f"unknown fusion method {changes['method']!r}; registered: {', '.join(METHODS)}",
                       param="rag_kvcache.method", code="invalid_method")
    try:
        return replace(index.config.fusion, **changes)
    except ValueError as e:
        raise APIError(400, str(e), param="rag_kvcache") from None


def _generation(index: KVIndex, request: Sampling, config: ServerConfig) -> GenerationConfig:
    limit = request.completion_limit()
    if limit is not None and limit > config.max_tokens:
        raise APIError(400, f"max_tokens is {limit}, above this server's limit of {config.max_tokens}",
                       param="max_tokens", code="max_tokens_exceeded")
    default = min(index.config.generation.max_new_tokens, config.max_tokens)
    generation = index.config.generation.with_options(
        max_new_tokens=limit or default, temperature=request.temperature, top_p=request.top_p, seed=request.seed,
        stop=request.stops(), json_schema=request.json_schema(),
    )
    if generation.json_schema is not None:  # refused now, before any answer: not mid-stream
        try:
            JsonSchemaConstraint(index.adapter.tokenizer, index.adapter.eos_token_ids, generation.json_schema)
        except ImportError as e:
            raise APIError(400, f"this server cannot constrain answers to a response_format: {e}",
                           param="response_format", code="unsupported_response_format") from None
        except ValueError as e:
            raise APIError(400, f"invalid response_format: {e}", param="response_format") from None
    return generation


def _chunks(index: KVIndex, request: Sampling, query: str) -> list[tuple[ChunkRecord, float | None]]:
    """The chunks the request names (`chunk_ids`) or asks to retrieve (`top_k`) for `query`."""
    options = request.rag_kvcache
    if options.chunk_ids is not None:
        try:
            return [(record, None) for record in index.chunks.get(options.chunk_ids)]
        except KeyError as e:
            raise APIError(400, str(e.args[0]), param="rag_kvcache.chunk_ids", code="unknown_chunk") from None
    if options.top_k is not None:
        if not query.strip():
            raise APIError(400, "rag_kvcache.top_k retrieves for the last user message, which is empty",
                           param="rag_kvcache.top_k")
        return [(hit.chunk, float(hit.score)) for hit in index.search(query, options.top_k)]
    return []


def chat_prompt(generator: FusedGenerator, request: ChatCompletionRequest, config: ServerConfig, salt: str) -> Prompt:
    """Chat messages as segments (runs on the engine's thread; `FusedGenerator.chat_segments`): chunks named or
    retrieved go at the head of the last user message; every indexed chunk quoted in the messages is found by
    its token ids and read from the cache. A chat too long for the limits drops its oldest half of messages
    (`history`: halve) rather than being refused."""
    index = generator.index
    turns = [ChatTurn("system" if m.role == "developer" else m.role, tuple(m.text_parts())) for m in request.messages]
    users = [turn for turn in turns if turn.role == "user"]
    if not users:
        raise APIError(400, "messages need at least one user message", param="messages")
    found = _chunks(index, request, "\n".join(p for p in users[-1].parts if isinstance(p, str)))
    fusion, generation = _fusion(index, request), _generation(index, request, config)
    records = [record for record, _ in found]
    try:
        if config.history == "halve":
            limit = min(config.max_prompt_tokens, index.adapter.context_length - generation.max_new_tokens)
            segments, dropped = generator.fitted_chat(turns, records, fusion, limit, salt)
        else:
            segments, dropped = generator.chat_segments(turns, records, fusion), 0
    except PromptTooLongError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return _checked(index, Prompt(segments, _described(found), fusion, generation, salt, dropped), config)


def completion_prompt(generator: FusedGenerator, request: CompletionRequest, config: ServerConfig, salt: str) -> Prompt:
    """A completion prompt as segments (runs on the engine's thread): with chunks named or retrieved,
    `ask`'s layout with the prompt as the question; without, the prompt as given, every indexed chunk
    quoted in it found by its token ids and read from the cache."""
    index = generator.index
    found = _chunks(index, request, request.text)
    fusion = _fusion(index, request)
    tokenizer = index.adapter.tokenizer
    if found:
        try:
            question = index.format.question_ids(tokenizer, request.text)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        segments = index.format.segments([record.token_ids for record, _ in found], question)
    else:
        ids = tuple(tokenizer(request.text).input_ids)
        if not request.text.strip() or not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        segments = generator.find_chunks([Segment(ids, cacheable=False, label="prompt")], fusion)
    return _checked(index, Prompt(segments, _described(found), fusion, _generation(index, request, config), salt), config)


def _described(found: list[tuple[ChunkRecord, float | None]]) -> list[dict[str, Any]]:
    return [{"id": record.id, "source": record.source, "score": score} for record, score in found]


def _checked(index: KVIndex, prompt: Prompt, config: ServerConfig) -> Prompt:
    """Refuse a prompt over the server's limit, or one that with the tokens it may generate does not
    fit the model's context."""
    n, limit = prompt.n_tokens, index.adapter.context_length
    if n > config.max_prompt_tokens:
        raise APIError(400, f"the prompt has {n} tokens, above this server's limit of {config.max_prompt_tokens}",
                       param="messages", code="context_length_exceeded")
    if n + prompt.generation.max_new_tokens > limit:
        raise APIError(400, f"the prompt has {n} tokens and up to {prompt.generation.max_new_tokens} more may be "
                       f"generated, beyond the model's {limit} positions", param="max_tokens",
                       code="context_length_exceeded")
    return prompt
