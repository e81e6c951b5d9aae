"""ASGI middleware of the server: a body-size limit enforced before anything is parsed, and a count of
every response by route and status (the server's, and its tenant's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import APIError
from .metrics import RequestMetrics, ServerMetrics

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/retrieve",
    "/v1/documents",
    "/metrics",
    "/health",
)


class HTTPMiddleware:
    """ASGI middleware that acts on HTTP requests (`http`) and hands every other scope (lifespan, websocket) to
    `app` as it came."""

    app: Any

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def http(self, scope: dict, receive: Callable, send: Callable) -> None:
        raise NotImplementedError


class LimitBody(HTTPMiddleware):
    """ASGI middleware: reads a request's body before the route does, and answers 413 once it is larger than
    `max_bytes` (said by its Content-Length or counted as it arrives), without parsing any of it: a 20 MB
    chat body was once tokenised whole on the engine's thread before its prompt was found too long."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def http(self, scope: dict, receive: Callable, send: Callable) -> None:
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
            error = APIError(
                413,
                f"the request body is larger than this server's max_body_bytes ({self.max_bytes})",
                code="request_too_large",
            )
            await error.response()(scope, receive, send)
            return
        pending = iter(body)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)


class CountRequests(HTTPMiddleware):
    """ASGI middleware: counts every HTTP response by route and status (streams included), in the server's
    metrics and in those `tenant_metrics` finds for the request's headers (its key's; None: no tenant's)."""

    def __init__(
        self,
        app: Any,
        metrics: ServerMetrics,
        tenant_metrics: Callable[[dict[bytes, bytes]], RequestMetrics | None] = lambda headers: None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.tenant_metrics = tenant_metrics

    async def http(self, scope: dict, receive: Callable, send: Callable) -> None:
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
            if (own := self.tenant_metrics(dict(scope["headers"]))) is not None:
                own.requests.labels(route, str(status)).inc()
