"""The OpenAI response to a completion request, from what its generation yields (text pieces, then the
`Answer`): one JSON body, or server-sent events (a chunk per piece, the finish, the usage when asked, `[DONE]`).
A failure after the status line is sent goes into the stream as an OpenAI-shaped error, as OpenAI's does."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..query.answers import Answer
from ..query.request import Prompt
from .errors import APIError, ClientGone
from .schemas import Sampling

log = logging.getLogger(__name__)

# A request's generation: text pieces, then its `Answer`; polls the request it is given for a disconnect
# (None: a streaming response, which learns of one when the server cancels it).
Generate = Callable[[Request | None], AsyncGenerator[str | Answer, None]]


async def respond(
    generate: Generate, model_id: str, prompt: Prompt, body: Sampling, request: Request, chat: bool
) -> Response:
    """A chat completion (`chat`) or a text completion of `prompt`, as JSON or, with `body.stream`, as events."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
    }
    if not body.stream:
        pieces: list[str] = []
        try:
            async with aclosing(generate(request)) as steps:
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
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            if chat
            else {"index": 0, "text": text, "logprobs": None}
        )
        return JSONResponse(
            head
            | {
                "choices": [choice | {"finish_reason": answer.finish_reason}],
                "usage": _usage(answer),
                "rag_kvcache": _extension(prompt, answer),
            }
        )

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
            async with aclosing(generate(None)) as steps:
                async for step in steps:
                    if isinstance(step, str):
                        if step:
                            yield chunk(step, None)
                        continue
                    yield chunk(None if chat else "", step.finish_reason)
                    if body.include_usage:
                        yield _sse(
                            head | {"choices": [], "usage": _usage(step), "rag_kvcache": _extension(prompt, step)}
                        )
        except ValueError as e:
            yield _sse(APIError(400, str(e), param="rag_kvcache").body())
        except Exception as e:  # the status line is sent: the error goes in the stream, as OpenAI's does
            log.exception("error while streaming %s", rid)
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())
        yield _sse("[DONE]")

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _usage(answer: Answer) -> dict[str, Any]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.generated_tokens,
        "total_tokens": answer.prompt_tokens + answer.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
    }


def _extension(prompt: Prompt, answer: Answer) -> dict[str, Any]:
    """The `rag_kvcache` field of a response: what the fusion did."""
    return {
        "chunks": prompt.chunks,
        **answer.fusion_stats,
        "prompt_tokens": answer.prompt_tokens,
        "dropped_messages": prompt.dropped,
    }


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
