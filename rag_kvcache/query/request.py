"""A front end's request made into the prompt the generator fuses: the one place the server and both
integrations build one.

A front end translates only its own types: its messages into `ChatTurn`s (chunks named inside them as
`ChunkPart`s), its options into `Options` (chunks by id or retrieved, fusion, sampling), and a
`RequestError` (which names the offending parameter in the library's terms: `chunk_ids`, `top_k`, `method`,
`fusion`, `max_tokens`, `response_format`, `messages`, `prompt`) into its own error. `chat_prompt` and
`completion_prompt` run on the engine's thread (they read the index and tokenize).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import FusionConfig, GenerationConfig
from ..engine.constraints import JsonSchemaConstraint
from ..engine.methods import METHODS
from ..engine.prompt import ChatTurn, Segment
from ..errors import RagKVCacheError
from ..index import KVIndex
from ..retrieval.records import ChunkRecord
from .answers import PromptTooLongError
from .generator import FusedGenerator
from .layout import warn_unquoted


class RequestError(RagKVCacheError, ValueError):
    """A request that cannot be served as asked; `param` names the parameter at fault, `code` the kind."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Options:
    """What a request asks beside its messages. Chunks: `chunk_ids` (those chunks) or `top_k` (retrieved
    for the last user message), at the head of the last user turn. `fusion`: a `FusionConfig` to use as it
    is, or changes to the index's fusion defaults (`FusionConfig` fields). Sampling: each None keeps the index's setting; `max_tokens` also at
    most `max_tokens_limit` (a deployment's cap, which is then the default too)."""

    chunk_ids: Sequence[str] | None = None
    top_k: int | None = None
    fusion: FusionConfig | Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    max_tokens_limit: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] | None = None
    json_schema: str | None = None


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as segments, the chunks fused into it, and how to fuse and decode."""

    segments: list[Segment]
    chunks: list[dict[str, Any]]  # id, source, score (None for chunks named by id)
    fusion: FusionConfig
    generation: GenerationConfig
    salt: str = ""  # the tenant (and the request's cache_salt) whose caches of request text it reads
    dropped: int = 0  # the chat's oldest messages left out to fit (`ChatFit.fitted`)
    turns: tuple[ChatTurn, ...] = ()  # a chat's turns as sent
    fit: int | None = None  # the most tokens a chat's prompt was fitted to (`chat_prompt`'s `fit`, with room to answer)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


_SAMPLING = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}  # setting -> parameter


def fusion_of(index: KVIndex, options: Options) -> FusionConfig:
    """The request's fusion settings: as given, or the index's with the request's changes."""
    method = options.fusion.method if isinstance(options.fusion, FusionConfig) else options.fusion.get("method")
    if method is not None and method not in METHODS:
        raise RequestError(
            f"unknown fusion method {method!r}; registered: {', '.join(METHODS)}", "method", "invalid_method"
        )
    if isinstance(options.fusion, FusionConfig):
        fusion = options.fusion
    else:
        try:
            fusion = replace(index.config.query.fusion, **options.fusion)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), "fusion") from None
    try:
        return fusion.check_model(index.model.layout.n_layers, index.config.index.chunk_tokens)
    except ValueError as e:  # its message begins with the parameter's name
        raise RequestError(str(e), f"fusion.{str(e).split()[0]}") from None


def generation_of(index: KVIndex, options: Options) -> GenerationConfig:
    """The index's generation settings with the request's options; a JSON Schema is checked now, before
    any answer (not mid-stream)."""
    cap, defaults = options.max_tokens_limit, index.config.query.generation
    if options.max_tokens is not None and cap is not None and options.max_tokens > cap:
        raise RequestError(
            f"max_tokens is {options.max_tokens}, above this server's limit of {cap}",
            "max_tokens",
            "max_tokens_exceeded",
        )
    try:
        generation = defaults.with_options(
            max_new_tokens=options.max_tokens
            if options.max_tokens is not None
            else (None if cap is None else min(defaults.max_new_tokens, cap)),
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop=options.stop,
            json_schema=options.json_schema,
        )
    except ValueError as e:  # a setting out of range: its message begins with the setting's name
        raise RequestError(
            str(e), next((p for name, p in _SAMPLING.items() if str(e).startswith(name)), "sampling")
        ) from None
    if generation.json_schema is not None:
        try:
            JsonSchemaConstraint(index.model.tokenizer, index.model.eos_token_ids, generation.json_schema)
        except ImportError as e:
            raise RequestError(
                f"answers cannot be constrained to a JSON Schema here: {e}",
                "response_format",
                "unsupported_response_format",
            ) from None
        except ValueError as e:
            raise RequestError(f"invalid response_format: {e}", "response_format") from None
    return generation


def chunks_of(index: KVIndex, options: Options, query: str) -> list[tuple[ChunkRecord, float | None]]:
    """The chunks the request names (`chunk_ids`) or asks to retrieve (`top_k`) for `query`, best first, with
    their retrieval scores (None for chunks named)."""
    if options.chunk_ids is not None:
        try:
            return [(record, None) for record in index.chunks.get(list(options.chunk_ids))]
        except KeyError as e:
            raise RequestError(str(e.args[0]), "chunk_ids", "unknown_chunk") from None
    if options.top_k is not None:
        if not query.strip():
            raise RequestError("top_k retrieves for the last user message, which is empty", "top_k")
        return [(hit.chunk, float(hit.score)) for hit in index.search(query, options.top_k)]
    return []


def laid_out(index: KVIndex, options: Options, found: list[tuple[ChunkRecord, float | None]]) -> list[ChunkRecord]:
    """The chunks of `chunks_of` as the prompt lays them out: retrieved ones in the index's `chunk_order`, named
    ones in the order the request names them."""
    records = [record for record, _ in found]
    return records if options.chunk_ids is not None else index.config.query.in_prompt_order(records)


def chat_prompt(
    generator: FusedGenerator,
    turns: Sequence[ChatTurn],
    options: Options = Options(),
    salt: str = "",
    fit: int | None = None,
) -> Prompt:
    """Chat turns as segments (`PromptLayout.chat_segments`): chunks named or retrieved go at the head of
    the last user turn; every indexed chunk quoted in the turns is found by its token ids and read from the
    cache. With `fit` (a most prompt tokens), a chat longer than that, or than the model's context leaves
    beside the answer, drops its oldest half of turns (`ChatFit.fitted`) rather than being refused."""
    index = generator.index
    users = [turn for turn in turns if turn.role == "user"]
    found = chunks_of(index, options, "\n".join(p for p in users[-1].parts if isinstance(p, str)) if users else "")
    fusion, generation = fusion_of(index, options), generation_of(index, options)
    records = laid_out(index, options, found)
    limit = None if fit is None else min(fit, index.model.context_length - generation.max_new_tokens)
    try:
        if limit is not None:
            segments, dropped = generator.fit.fitted(turns, records, fusion, limit, salt)
        else:
            segments, dropped = generator.layout.chat_segments(turns, records, fusion), 0
    except PromptTooLongError as e:
        raise RequestError(str(e), "messages", "context_length_exceeded") from None
    except ValueError as e:
        raise RequestError(str(e), "messages") from None
    warn_unquoted(segments, fusion)
    return Prompt(segments, _described(found), fusion, generation, salt, dropped, tuple(turns), limit)


def completion_prompt(generator: FusedGenerator, text: str, options: Options = Options(), salt: str = "") -> Prompt:
    """A completion prompt as segments: with chunks named or retrieved, `ask`'s layout with the text as the
    question; without, the text as given, every indexed chunk quoted in it found by its token ids and read
    from the cache."""
    index = generator.index
    found = chunks_of(index, options, text)
    fusion, tokenizer = fusion_of(index, options), index.model.tokenizer
    if found:
        try:
            question = index.format.question_ids(tokenizer, text)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        segments = index.format.segments([record.token_ids for record in laid_out(index, options, found)], question)
    else:
        ids = tuple(tokenizer(text).input_ids)
        if not text.strip() or not ids:
            raise RequestError("the prompt is empty", "prompt")
        segments = generator.layout.find_chunks([Segment(ids, cacheable=False, label="prompt")], fusion)
        warn_unquoted(segments, fusion)
    return Prompt(segments, _described(found), fusion, generation_of(index, options), salt)


def _described(found: list[tuple[ChunkRecord, float | None]]) -> list[dict[str, Any]]:
    return [{"id": record.id, "source": record.source, "score": score} for record, score in found]
