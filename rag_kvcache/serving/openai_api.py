"""`rag-kvcache serve`: an OpenAI-compatible HTTP server over one `Engine` (model loaded once).

Routes: `POST /v1/chat/completions` and `POST /v1/completions` (server-sent events when `stream`,
with `stream_options.include_usage`), `GET /v1/models`, `POST /v1/retrieve` (top-k chunks),
`POST /v1/documents` (write documents into the folder the index mirrors and sync it), `GET
/metrics` (Prometheus) and `GET /health`. With an API key every route but `/health` needs
`Authorization: Bearer KEY`.

All model work runs on the engine's worker thread, driven by the `Scheduler`: a RAG request's fused
prefill is its own (a selective recompute no other request shares) and runs alone, one between two
decoding steps; concurrent requests decode together, one batched model step advancing up to
`max_batch` of them by a token (continuous batching; why and what it gains:
`benchmarks/serve/README.md`). Admitted requests wait in a bounded FIFO queue for one of the
`max_batch` places; past `max_queue` waiting a request is refused with 429 and `Retry-After`. A
client that disconnects stops its generation at the next token (or leaves the queue). Errors are
OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): a bad body, an unknown field, a
wrong type or a request over the limits is a 400, never a 500.

Prompts: reuse is transparent. Any prompt is tokenised whole and every indexed chunk quoted in it is
found by its token ids (the index's chunk matching) and read from the cache, the rest computed.
Chunks named in `rag_kvcache.chunk_ids`, or retrieved with `rag_kvcache.top_k` for the last user
message, are spliced in by their stored ids instead: at the head of the last user message (chat,
`chat_segments`), or in `ask`'s layout with the prompt as the question (completions).
Message text is text: a control-token string in a chat message (`<|im_start|>`) is spelt out, never a
control token (`engine.prompt.shield`), on every chat path. A `/v1/completions` prompt without chunks
is the client's whole raw prompt, its control tokens kept (it may be the client's own template, as with
OpenAI's and vLLM's completions); with chunks, the prompt is the question and is spelt out too.
A request body over `max_body_bytes` is a 413, refused before it is read whole or parsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import FusionConfig, GenerationConfig
from ..engine.generation import JsonSchemaConstraint
from ..engine.methods import METHODS
from ..engine.prompt import ChatTurn, Segment
from ..errors import RagKVCacheError
from ..generator import Answer, FusedGenerator, PromptTooLongError
from ..index import KVIndex
from ..retrieval.chunk_index import ChunkRecord
from ..version import __version__
from .engine import Engine
from .metrics import ServerMetrics
from .scheduler import Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, DocumentsRequest, RetrieveRequest, Sampling
from .settings import ServerConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

NAME_MAX = 255  # bytes in a file name (ext4, APFS, NTFS)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/retrieve", "/v1/documents", "/metrics",
          "/health")


class APIError(RagKVCacheError):
    """An error answered as OpenAI's API answers it."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(RagKVCacheError):
    """The client disconnected before its answer was complete."""


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


# ---- admission --------------------------------------------------------------------------------------
class Admission:
    """At most `max_batch + max_queue` requests admitted at once (a burst of requests all waiting at once
    fills both): generations go to the scheduler, which decodes at most `max_batch` together and chooses
    which waiting one to prefill next; other engine work (documents) takes one of `max_batch` places in
    arrival order. At most `max_per_key` admitted requests are one tenant's (an API key's; 0: no limit;
    requests without a key are not counted)."""

    def __init__(self, max_queue: int, max_batch: int, metrics: ServerMetrics, max_per_key: int = 0) -> None:
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_per_key = max_per_key
        self.metrics = metrics
        self.waiting = 0
        self.active = 0
        self.in_flight: dict[str, int] = {}  # per tenant: its requests waiting or served
        self._slot = asyncio.Semaphore(max_batch)
        self._service_s = 1.0  # moving average of a request's service time, for Retry-After

    def admit(self, tenant: str = "") -> Ticket:
        """A place in the queue, or a 429 when the queue is full or `tenant` has its most requests in flight."""
        retry = max(1, math.ceil(self._service_s * (self.waiting + self.active) / self.max_batch))
        if self.waiting >= self.max_queue + self.max_batch - self.active:
            self.metrics.rejected.inc()
            raise APIError(429, f"the server is busy ({self.waiting} requests waiting); retry in {retry} s",
                           type="rate_limit_error", code="server_busy", headers={"Retry-After": str(retry)})
        if tenant and self.max_per_key and self.in_flight.get(tenant, 0) >= self.max_per_key:
            self.metrics.rejected.inc()
            raise APIError(429, f"this API key has {self.max_per_key} requests in flight, the most this server allows "
                           f"one key (max_per_key); retry in {retry} s", type="rate_limit_error", code="key_busy",
                           headers={"Retry-After": str(retry)})
        self._set_waiting(+1)
        if tenant:
            self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return Ticket(self, tenant)

    def _left(self, tenant: str) -> None:
        if tenant:
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]

    def _set_waiting(self, delta: int) -> None:
        self.waiting += delta
        self.metrics.queue_depth.set(self.waiting)

    def _set_active(self, delta: int) -> None:
        self.active += delta
        self.metrics.active.set(self.active)

    def served(self, seconds: float) -> None:
        self._service_s = 0.8 * self._service_s + 0.2 * seconds


class Ticket:
    """An admitted request: waits for the engine in `serve()`; `close()` gives its place back."""

    def __init__(self, admission: Admission, tenant: str = "") -> None:
        self._admission = admission
        self._tenant = tenant
        self._queued = True
        self._open = True
        self.admitted_at = time.perf_counter()

    @asynccontextmanager
    async def serve(self, slot: bool = True) -> AsyncIterator[None]:
        """In service until the block ends: after one of the `max_batch` places is free (`slot`), or at once
        for a generation, which the scheduler queues itself (it prefills the waiting request it chooses,
        `Scheduler.order`, and decodes at most `max_batch`) and whose queueing time it records."""
        adm = self._admission
        if slot:
            await adm._slot.acquire()
        self._queued = False
        adm._set_waiting(-1)
        adm._set_active(+1)
        started = time.perf_counter()
        if slot:
            adm.metrics.queue_wait.observe(started - self.admitted_at)
        try:
            yield
        finally:
            adm._set_active(-1)
            if slot:
                adm._slot.release()
            adm.served(time.perf_counter() - started)

    def close(self) -> None:
        """Give the place back (served or not); once."""
        if self._queued:
            self._queued = False
            self._admission._set_waiting(-1)
        if self._open:
            self._open = False
            self._admission._left(self._tenant)


# ---- prompts ------------------------------------------------------------------------------------------
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


# ---- the server -----------------------------------------------------------------------------------------
class Server:
    """The routes' shared state: the engine, the admission queue, the metrics."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_id = engine.index.config.model
        self.created = int(time.time())
        # No token spans more characters than the vocabulary's longest entry (a byte-level entry's symbols are
        # bytes, one or more per character): a prompt with more characters than this can never fit the limit.
        self.max_prompt_chars = config.max_prompt_tokens * max(map(len, engine.index.adapter.tokenizer.get_vocab()))
        conversations = engine.generator.conversations
        self.metrics = ServerMetrics(engine.index.store.stats, None if conversations is None else lambda: conversations.stats)
        self.admission = Admission(config.max_queue, config.max_batch, self.metrics, config.max_per_key)
        # Threads that wait on the engine's worker for one step each (the worker does the work).
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rag-kvcache-serve")
        self.scheduler = Scheduler(engine.generator, self.on_engine, config.max_batch, self.metrics, config.order)

    async def close(self) -> None:
        await self.scheduler.close()
        self._waiters.shutdown(wait=False, cancel_futures=True)

    async def on_engine(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the engine's worker thread, awaited."""
        return await asyncio.wrap_future(self._waiters.submit(self.engine.run, fn, *args))

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    async def generate(self, ticket: Ticket, prompt: Prompt, request: Request | None) -> AsyncIterator[str | Answer]:
        """Wait for a place, then stream `prompt` from the scheduler (text pieces, then the `Answer`);
        records the metrics. Closing the stream early (the client left) takes the request out before
        the scheduler's next step. `request` (non-streaming responses) is polled for a disconnect before
        each step; a streaming response learns of one when the server cancels it."""
        try:
            async with ticket.serve(slot=False), aclosing(
                self.scheduler.stream(prompt.segments, prompt.fusion, prompt.generation, prompt.salt)
            ) as steps:
                if request is not None and await request.is_disconnected():
                    raise ClientGone
                async for step in steps:
                    if isinstance(step, Answer):
                        self.metrics.observe(step, time.perf_counter() - ticket.admitted_at)
                    yield step
                    if request is not None and await request.is_disconnected():
                        raise ClientGone
        except (ClientGone, asyncio.CancelledError):
            self.metrics.cancelled.inc()
            log.info("client disconnected: generation stopped")
            raise
        finally:
            ticket.close()


def _usage(answer: Answer) -> dict[str, Any]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.generated_tokens,
            "total_tokens": answer.prompt_tokens + answer.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}


def _extension(prompt: Prompt, answer: Answer) -> dict[str, Any]:
    """The `rag_kvcache` field of a response: what the fusion did."""
    return {"chunks": prompt.chunks, **answer.fusion_stats, "prompt_tokens": answer.prompt_tokens,
            "dropped_messages": prompt.dropped}


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (which the caller opened and closes), with `config`'s limits
    (default: `ServerConfig()`)."""
    config = config or ServerConfig()
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await server.close()

    app = FastAPI(title="rag-kvcache", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = server

    tenants = {key.encode(): hashlib.sha256(key.encode()).hexdigest()[:32] for key in config.api_keys}

    async def authorize(request: Request) -> str:
        """The request's tenant: an id derived from its API key ("" without keys), or a 401."""
        if not tenants:
            return ""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        matches = [tenant for known, tenant in tenants.items() if secrets.compare_digest(given, known)]  # every key compared
        if scheme.lower() != "bearer" or not matches:
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                           type="authentication_error", code="invalid_api_key")
        return matches[0]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        try:  # the body is parsed before the route's dependencies run: a caller without a key learns nothing of it
            await authorize(request)
        except APIError as denied:
            return denied.response()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    app.add_middleware(_LimitBody, max_bytes=config.max_body_bytes)
    app.add_middleware(_CountRequests, metrics=server.metrics)
    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_id, "queue_depth": server.admission.waiting,
                "active": server.admission.active}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "rag-kvcache"}]}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/retrieve", dependencies=auth)
    async def retrieve(body: RetrieveRequest) -> dict[str, Any]:
        try:
            hits = await server.on_engine(server.engine.index.search, body.query, body.top_k)
        except ValueError as e:
            raise APIError(400, str(e), param="query") from None
        return {"object": "list", "data": [
            {"id": h.chunk.id, "source": h.chunk.source, "score": float(h.score), "text": h.chunk.text} for h in hits]}

    @app.post("/v1/documents", dependencies=auth)
    async def add_documents(body: DocumentsRequest) -> dict[str, Any]:
        if config.docs_dir is None:
            raise APIError(400, "this server was started without a documents folder (`serve --docs DIR`)",
                           code="documents_disabled")
        paths = [_document_path(config.docs_dir, doc.source) for doc in body.documents]
        limit = server.engine.index.config.max_file_bytes
        if large := [doc.source for doc in body.documents if len(doc.text.encode()) > limit]:  # never indexed: not written
            raise APIError(400, f"documents {large} are larger than the index's max_file_bytes ({limit} bytes)",
                           param="documents.text", code="document_too_large")
        ticket = server.admission.admit()
        try:
            async with ticket.serve():
                report = await server.on_engine(_write_and_sync, server.engine.index, config.docs_dir, paths,
                                                [doc.text for doc in body.documents])
        finally:
            ticket.close()
        return {"added": report.added, "changed": report.changed, "removed": report.removed,
                "unchanged": len(report.unchanged), "skipped": [s.source for s in report.skipped],
                "new_chunks": [{"id": c.id, "source": c.source} for c in report.new_chunks],
                "chunks": len(server.engine.index.chunks)}

    async def answer(body, request: Request, tenant: str, build_prompt, chat: bool) -> Response:
        """Admit the request, build its prompt on the engine's thread, and answer it (streamed or not),
        reading and writing caches of its request text as its tenant's (and its `cache_salt`'s)."""
        server.check_model(body.model)
        if (chars := body.prompt_chars()) > server.max_prompt_chars:  # refused before tokenising it
            raise APIError(400, f"the prompt has {chars} characters, more than {config.max_prompt_tokens} tokens (this "
                           f"server's limit) can hold in this model's vocabulary", param=body.prompt_field,
                           code="context_length_exceeded")
        ticket = server.admission.admit(tenant)
        salt = f"{tenant}:{body.cache_salt}" if body.cache_salt else tenant
        try:
            prompt = await server.on_engine(build_prompt, server.engine.generator, body, config, salt)
        except BaseException:
            ticket.close()
            raise
        return await _respond(server, ticket, prompt, body, request, chat=chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str = Depends(authorize)) -> Response:
        return await answer(body, request, tenant, chat_prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: str = Depends(authorize)) -> Response:
        return await answer(body, request, tenant, completion_prompt, chat=False)

    return app


async def _respond(server: Server, ticket: Ticket, prompt: Prompt, body: Sampling, request: Request,
                   chat: bool) -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_id}
    if not body.stream:
        pieces: list[str] = []
        try:
            async with aclosing(server.generate(ticket, prompt, request)) as steps:
                async for step in steps:
                    if isinstance(step, str):
                        pieces.append(step)
                    else:
                        answer = step
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        except ValueError as e:  # what the fusion refuses (e.g. ratio 'auto' without calibration)
            raise APIError(400, str(e), param="rag_kvcache") from None
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
                  if chat else {"index": 0, "text": text, "logprobs": None})
        return JSONResponse(head | {"choices": [choice | {"finish_reason": answer.finish_reason}],
                                    "usage": _usage(answer), "rag_kvcache": _extension(prompt, answer)})

    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _sse(head | {"choices": [choice]} | usage_field)

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                yield chunk("", None, role=True)
            async with aclosing(server.generate(ticket, prompt, None)) as steps:
                async for step in steps:
                    if isinstance(step, str):
                        if step:
                            yield chunk(step, None)
                        continue
                    yield chunk(None if chat else "", step.finish_reason)
                    if body.include_usage:
                        yield _sse(head | {"choices": [], "usage": _usage(step),
                                           "rag_kvcache": _extension(prompt, step)})
        except ValueError as e:
            yield _sse(APIError(400, str(e), param="rag_kvcache").body())
        except Exception as e:  # the status line is sent: the error goes in the stream, as OpenAI's does
            log.exception("error while streaming %s", rid)
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request body, as an OpenAI-style 400."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif first.get("type") == "missing":
        message = f"missing required field {param!r}"
    else:
        message = f"{param + ': ' if param else ''}{first['msg']}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, message + more, param=param, code="invalid_request")


def _document_path(docs_dir: Path, source: str) -> Path:
    """Where a posted document goes: a relative path inside `docs_dir`, no hidden or parent parts, no
    control characters, each name short enough for its temporary file's (`.NAME.tmp`), through folders
    (not files, not links) only: a link inside the folder once let a document land outside it."""
    rel = PurePosixPath(source)  # "." and "./" have no parts: the folder itself, written over by the document
    if not rel.parts or rel.is_absolute() or "\\" in source or any(
            part in ("", "..") or part.startswith(".") for part in rel.parts):
        raise _bad_source(source, "a relative path inside the documents folder, without hidden or '..' parts")
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise _bad_source(source, "without control characters")
    if any(len(part.encode()) > NAME_MAX - len("..tmp") for part in rel.parts):
        raise _bad_source(source, f"with names of at most {NAME_MAX - len('..tmp')} bytes")
    path = docs_dir
    for i, part in enumerate(rel.parts):
        path = path / part
        if path.is_symlink():
            raise _bad_source(source, f"not through a link ({'/'.join(rel.parts[: i + 1])!r} is one)")
        last = i == len(rel.parts) - 1
        if path.is_dir() if last else path.exists() and not path.is_dir():
            raise _bad_source(source, f"a path through folders to a file ({'/'.join(rel.parts[: i + 1])!r} is "
                                      f"{'a folder' if last else 'a file'})")
    return path


def _bad_source(source: str, rule: str) -> APIError:
    return APIError(400, f"source must be {rule}; got {source!r}", param="documents.source", code="invalid_source")


def _write_and_sync(index: KVIndex, docs_dir: Path, paths: list[Path], texts: list[str]):
    """Write the documents and sync the index with the folder (on the engine's thread)."""
    for path, text in zip(paths, texts, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return index.update(docs_dir, progress=False)


class _LimitBody:
    """ASGI middleware: reads a request's body before the route does, and answers 413 once it is larger than
    `max_bytes` (said by its Content-Length or counted as it arrives), without parsing any of it: a 20 MB
    chat body was once tokenised whole on the engine's thread before its prompt was found too long."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        body: list[dict] = []
        received, more = 0, not too_large
        while more:
            message = await receive()
            body.append(message)
            received += len(message.get("body", b""))
            too_large = received > self.max_bytes
            more = message["type"] == "http.request" and message.get("more_body", False) and not too_large
        if too_large:
            error = APIError(413, f"the request body is larger than this server's max_body_bytes ({self.max_bytes})",
                             code="request_too_large")
            await error.response()(scope, receive, send)
            return
        pending = iter(body)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)


class _CountRequests:
    """ASGI middleware: counts every HTTP response by route and status (streams included)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()


def serve(engine: Engine, config: ServerConfig) -> None:
    """Run the server until interrupted (uvicorn; logs through `logging`)."""
    import uvicorn

    uvicorn.run(create_app(engine, config), host=config.host, port=config.port, log_config=None,
                timeout_graceful_shutdown=5)
