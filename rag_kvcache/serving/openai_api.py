"""`rag-kvcache serve`: an OpenAI-compatible HTTP server over one `ServingEngine` (model loaded once).

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

This module is the app (routes and the shared `Server`); a request becomes its prompt in `prompts`, waits
in `admission`, is answered as JSON or events by `responses`, fails as `errors` says; `documents` writes
posted documents and `middleware` limits bodies and counts responses.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.prompt import ChatTurn
from ..engine.spec import Pause
from ..query.answers import Answer
from ..query.request import Prompt
from ..version import __version__
from .admission import Admission, Ticket
from .documents import checked_documents, write_and_sync
from .engine import ServingEngine
from .errors import APIError, ClientGone, validation_error
from .lending import LentThread
from .metrics import RequestMetrics, ServerMetrics
from .middleware import CountRequests, LimitBody
from .prompts import chat_prompt, completion_prompt
from .responses import respond
from .scheduler import Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, DocumentsRequest, RetrieveRequest
from .settings import ServerConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its key's tenant (caches and numbers of its own) and whether the key is an admin
    key (may change the documents and see every tenant's numbers)."""

    tenant: str
    admin: bool


def _tenant_of(key: str) -> str:
    """The tenant id of an API key: a digest, so that ids in caches and logs never hold the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


BACKFILL_QUIET_S = 0.5  # how long the server is quiet (no request started) before it makes caches in the background


class Server:
    """The routes' shared state: the engine, the admission queue, the metrics."""

    def __init__(self, engine: ServingEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_id = engine.index.config.index.model
        self.created = int(time.time())
        # No token spans more characters than the vocabulary's longest entry (a byte-level entry's symbols are
        # bytes, one or more per character): a prompt with more characters than this can never fit the limit.
        self.max_prompt_chars = config.max_prompt_tokens * max(map(len, engine.index.model.tokenizer.get_vocab()))
        conversations = engine.generator.conversations
        self.metrics = ServerMetrics(
            engine.index.store.stats,
            None if conversations is None else lambda: conversations.stats,
            None if conversations is None else conversations.tenants,
        )
        self._tenant_metrics: dict[str, RequestMetrics] = {}
        self._last_request = time.monotonic()  # when the latest request started (background work waits for quiet)
        self.admission = Admission(config.max_queue, config.max_batch, self.metrics, config.max_per_key)
        # Threads that wait on the engine's worker for one step each (the worker does the work).
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rag-kvcache-serve")
        prefetch = config.prefetches(engine.index.config.runtime.storage)
        self.scheduler = Scheduler(
            engine.generator, self.on_engine, config.max_batch, self.metrics, config.order, prefetch
        )
        self._filler: LentThread | None = None  # under a disk budget: makes the caches it admits (`_backfill`)
        self._filling = False  # a slice of the filler's time is queued with the scheduler

    def metrics_of(self, tenant: str) -> RequestMetrics:
        """`tenant`'s own metrics (its requests, its conversations), made at its first request."""
        if (own := self._tenant_metrics.get(tenant)) is None:
            conversations = self.engine.generator.conversations
            own = self._tenant_metrics[tenant] = RequestMetrics(
                None if conversations is None else partial(conversations.stats_of, tenant)
            )
        return own

    async def close(self) -> None:
        await self.scheduler.close()
        if self._filler is not None:
            await asyncio.to_thread(self._filler.close)
        self._waiters.shutdown(wait=False, cancel_futures=True)

    async def on_engine(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the engine's worker thread, awaited."""
        return await asyncio.wrap_future(self._waiters.submit(self.engine.run, fn, *args))

    def _prepare_fit(self, prompt: Prompt, answer: str) -> None:
        """A chat that may outgrow its limit at the next turn: its shortened history prepared while the
        server is idle (`FusedGenerator.prepare_fit`), so that turn reads it from the conversation cache."""
        if prompt.fit is None or not prompt.turns:
            return
        turns = [*prompt.turns, ChatTurn("assistant", (answer,))]
        generator = self.engine.generator
        self.scheduler.later(
            partial(
                generator.prepare_fit, turns, prompt.fusion, prompt.fit, prompt.salt, prompt.n_tokens, prompt.dropped
            )
        )

    def _backfill(self) -> None:
        """Chunk caches the prompts wanted and did not find (`CacheOpener.backfill`), made once the server has been
        quiet for `BACKFILL_QUIET_S` (no request started since), one at a time, until one starts: under steady
        load a request never waits for one.

        Under a disk budget, where a chunk outside the hot set is computed in the prompt until its cache is made,
        those the budget admits are made in every moment no request waits or decodes, and the others dropped (a
        chunk read again is wanted again), so that the hot set follows the questions under steady load too. They
        are made on a thread of their own (`LentThread`) in slices of `ServerConfig.backfill_slice_s` (default: no
        bound), stopped before a model layer once one is spent and resumed at the next such moment."""
        caches = self.engine.index.caches
        if not caches.wanted:
            return
        loop = asyncio.get_running_loop()
        if self.engine.index.store.budget is not None:
            if not self._filling:
                self._filling = True
                if self._filler is None:
                    self._filler = LentThread(self._make_wanted, "rag-kvcache-backfill")
                self.scheduler.later(partial(self._lend, self._filler, loop))
            return
        loop.call_later(BACKFILL_QUIET_S, self._backfill_if_quiet, loop)

    def _make_wanted(self, pause: Pause) -> bool:
        """On the filler's thread: one wanted cache made, if the budget admits it; whether more are wanted."""
        caches = self.engine.index.caches
        caches.backfill(1, pause)
        return bool(caches.wanted)

    def _lend(self, filler: LentThread, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine's thread, with no request waiting: a slice of time for the filler; the next slice is
        queued while it has more to do."""
        more = True
        try:
            more = filler.lend(self.config.backfill_slice_s)
        finally:
            loop.call_soon_threadsafe(self._lent, filler, loop, more)

    def _lent(self, filler: LentThread, loop: asyncio.AbstractEventLoop, more: bool) -> None:
        self._filling = more and self.scheduler.running
        if self._filling:
            self.scheduler.later(partial(self._lend, filler, loop))

    def _backfill_if_quiet(self, loop: asyncio.AbstractEventLoop) -> None:
        if time.monotonic() - self._last_request >= BACKFILL_QUIET_S and self.engine.index.caches.wanted:
            self.scheduler.later(partial(self._backfill_one, loop))

    def _backfill_one(self, loop: asyncio.AbstractEventLoop) -> None:
        """One wanted cache made (on the engine's thread), then the next one if the server is still quiet."""
        self.engine.index.caches.backfill()
        loop.call_soon_threadsafe(self._backfill_if_quiet, loop)

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def generate(
        self, ticket: Ticket, prompt: Prompt, request: Request | None
    ) -> AsyncGenerator[str | Answer, None]:
        """Wait for a place, then stream `prompt` from the scheduler (text pieces, then the `Answer`);
        records the metrics. Closing the stream early (the client left) takes the request out before
        the scheduler's next step. `request` (non-streaming responses) is polled for a disconnect before
        each step; a streaming response learns of one when the server cancels it."""
        self._last_request = time.monotonic()
        try:
            async with (
                ticket.serve(slot=False),
                aclosing(
                    self.scheduler.stream(prompt.segments, prompt.fusion, prompt.generation, prompt.salt)
                ) as steps,
            ):
                if request is not None and await request.is_disconnected():
                    raise ClientGone
                pieces: list[str] = []
                async for step in steps:
                    if isinstance(step, Answer):
                        for metrics in (self.metrics, self.metrics_of(ticket.tenant)):
                            metrics.observe(step, time.perf_counter() - ticket.admitted_at)
                        self._prepare_fit(prompt, "".join(pieces))
                        self._backfill()
                    else:
                        pieces.append(step)
                    yield step
                    if request is not None and await request.is_disconnected():
                        raise ClientGone
        except (ClientGone, asyncio.CancelledError):
            self.metrics.cancelled.inc()
            self.metrics_of(ticket.tenant).cancelled.inc()
            log.info("client disconnected: generation stopped")
            raise
        finally:
            ticket.close()


def create_app(engine: ServingEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (which the caller opened and closes), with `config`'s limits
    (default: `ServerConfig()`)."""
    config = config or ServerConfig()
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await server.close()

    app = FastAPI(
        title="rag-kvcache", version=__version__, docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.server = server

    keys = {key.encode(): Caller(_tenant_of(key), False) for key in config.api_keys} | {
        key.encode(): Caller(_tenant_of(key), True) for key in config.admin_keys
    }

    def caller_of(authorization: str) -> Caller | None:
        """The caller an `Authorization` header names (None: no key of this server's)."""
        scheme, _, key = authorization.partition(" ")
        given = key.strip().encode()
        matches = [c for known, c in keys.items() if secrets.compare_digest(given, known)]  # every key compared
        return matches[0] if scheme.lower() == "bearer" and matches else None

    def tenant_metrics(headers: dict[bytes, bytes]) -> RequestMetrics | None:
        """The metrics of the tenant whose key the headers carry (None without keys, or with a wrong one)."""
        caller = caller_of(headers.get(b"authorization", b"").decode("latin-1")) if keys else None
        return None if caller is None else server.metrics_of(caller.tenant)

    async def identify(request: Request) -> Caller:
        """Who sends the request: its key's tenant and whether the key may write, or a 401 (without keys:
        the one tenant "", which may write)."""
        if not keys:
            return Caller("", True)
        if (caller := caller_of(request.headers.get("authorization", ""))) is None:
            raise APIError(
                401,
                "missing or wrong API key: send `Authorization: Bearer KEY`",
                type="authentication_error",
                code="invalid_api_key",
            )
        return caller

    async def authorize(request: Request) -> str:
        """The request's tenant: an id derived from its API key ("" without keys), or a 401."""
        return (await identify(request)).tenant

    async def may_write(request: Request) -> Caller:
        """The caller, when its key may change the documents; else a 401 or 403."""
        caller = await identify(request)
        if not caller.admin:
            raise APIError(
                403,
                "this API key may only ask: changing the documents needs an admin key (`serve --admin-key`)",
                type="permission_error",
                code="insufficient_permissions",
            )
        return caller

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        try:  # the body is parsed before the route's dependencies run: a caller without a key learns nothing of it
            await (may_write if request.url.path == "/v1/documents" else identify)(request)
        except APIError as denied:
            return denied.response()
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    app.add_middleware(LimitBody, max_bytes=config.max_body_bytes)
    app.add_middleware(CountRequests, metrics=server.metrics, tenant_metrics=tenant_metrics)
    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": server.model_id,
            "queue_depth": server.admission.waiting,
            "active": server.admission.active,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": server.model_id, "object": "model", "created": server.created, "owned_by": "rag-kvcache"}],
        }

    @app.get("/metrics")
    async def metrics(caller: Caller = Depends(identify)) -> Response:
        """An admin key (or anyone, without keys) sees the whole server's numbers; another key its own."""
        shown = server.metrics if caller.admin else server.metrics_of(caller.tenant)
        return Response(shown.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/retrieve", dependencies=auth)
    async def retrieve(body: RetrieveRequest) -> dict[str, Any]:
        try:
            hits = await server.on_engine(server.engine.index.search, body.query, body.top_k)
        except ValueError as e:
            raise APIError(400, str(e), param="query") from None
        return {
            "object": "list",
            "data": [
                {"id": h.chunk.id, "source": h.chunk.source, "score": float(h.score), "text": h.chunk.text}
                for h in hits
            ],
        }

    @app.post("/v1/documents", dependencies=[Depends(may_write)])
    async def add_documents(body: DocumentsRequest) -> dict[str, Any]:
        if config.docs_dir is None:
            raise APIError(
                400,
                "this server was started without a documents folder (`serve --docs DIR`)",
                code="documents_disabled",
            )
        paths = checked_documents(
            config.docs_dir,
            [(doc.source, doc.text) for doc in body.documents],
            server.engine.index.config.runtime.max_file_bytes,
        )
        ticket = server.admission.admit()
        try:
            async with ticket.serve():
                report = await server.on_engine(
                    write_and_sync, server.engine.index, config.docs_dir, paths, [doc.text for doc in body.documents]
                )
        finally:
            ticket.close()
        return {
            "added": report.added,
            "changed": report.changed,
            "removed": report.removed,
            "unchanged": len(report.unchanged),
            "skipped": [s.source for s in report.skipped],
            "new_chunks": [{"id": c.id, "source": c.source} for c in report.new_chunks],
            "chunks": len(server.engine.index.chunks),
        }

    async def answer(body, request: Request, tenant: str, build_prompt, chat: bool) -> Response:
        """Admit the request, build its prompt on the engine's thread, and answer it (streamed or not),
        reading and writing caches of its request text as its tenant's (and its `cache_salt`'s)."""
        server.check_model(body.model)
        if (chars := body.prompt_chars()) > server.max_prompt_chars:  # refused before tokenising it
            raise APIError(
                400,
                f"the prompt has {chars} characters, more than {config.max_prompt_tokens} tokens (this "
                f"server's limit) can hold in this model's vocabulary",
                param=body.prompt_field,
                code="context_length_exceeded",
            )
        ticket = server.admission.admit(tenant)
        salt = f"{tenant}:{body.cache_salt}" if body.cache_salt else tenant
        try:
            prompt = await server.on_engine(build_prompt, server.engine.generator, body, config, salt)
        except BaseException:
            ticket.close()
            raise
        return await respond(partial(server.generate, ticket, prompt), server.model_id, prompt, body, request, chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, tenant: str = Depends(authorize)
    ) -> Response:
        return await answer(body, request, tenant, chat_prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: str = Depends(authorize)) -> Response:
        return await answer(body, request, tenant, completion_prompt, chat=False)

    return app


def serve(engine: ServingEngine, config: ServerConfig) -> None:
    """Run the server until interrupted (uvicorn; logs through `logging`)."""
    import uvicorn

    uvicorn.run(
        create_app(engine, config), host=config.host, port=config.port, log_config=None, timeout_graceful_shutdown=5
    )
