"""A request's prompt: an OpenAI chat or completion request translated into the library's request
(`rag_kvcache.query.request`: turns and `Options`), made into a prompt on the engine's thread; every refusal an
`APIError` naming this API's parameter, and the server's own limits checked."""

from __future__ import annotations

from ..engine.prompt import ChatTurn
from ..index import KVIndex
from ..query.generator import FusedGenerator
from ..query.request import Options, Prompt, RequestError
from ..query.request import chat_prompt as build_chat_prompt
from ..query.request import completion_prompt as build_completion_prompt
from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, Sampling
from .settings import ServerConfig

# the library's names of a request's parameters -> this API's fields
_PARAMS = {
    "method": "rag_kvcache.method",
    "fusion": "rag_kvcache",
    "chunk_ids": "rag_kvcache.chunk_ids",
    "top_k": "rag_kvcache.top_k",
}


def _options(request: Sampling, config: ServerConfig, retrieve: int | None = None) -> Options:
    """The request's options; `retrieve`: the top-k for a request that names no chunks of its own."""
    extension = request.rag_kvcache
    top_k = extension.top_k
    if extension.chunk_ids is None and top_k is None:
        top_k = retrieve
    return Options(
        chunk_ids=extension.chunk_ids,
        top_k=top_k or None,  # 0: the request opts out of retrieval
        fusion=extension.fusion_changes(),
        max_tokens=request.completion_limit(),
        max_tokens_limit=config.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stops(),
        json_schema=request.json_schema(),
    )


def _api_error(e: RequestError) -> APIError:
    param = _PARAMS.get(e.param, e.param)
    if param.startswith("fusion."):  # one fusion parameter: rag_kvcache.epic_k
        param = "rag_kvcache." + param.removeprefix("fusion.")
    return APIError(400, str(e), param=param, code=e.code)


def chat_prompt(generator: FusedGenerator, request: ChatCompletionRequest, config: ServerConfig, salt: str) -> Prompt:
    """Chat messages as a prompt (`request.chat_prompt`, on the engine's thread). A chat too long for the
    limits drops its oldest half of messages (`history`: halve) rather than being refused."""
    turns = [ChatTurn("system" if m.role == "developer" else m.role, tuple(m.text_parts())) for m in request.messages]
    if not any(turn.role == "user" for turn in turns):
        raise APIError(400, "messages need at least one user message", param="messages")
    if not any(isinstance(part, str) and part.strip() for turn in turns for part in turn.parts):
        raise APIError(400, "messages hold no text: every message's content is empty", param="messages")
    try:
        prompt = build_chat_prompt(
            generator,
            turns,
            _options(request, config, retrieve=config.top_k),  # `serve --top-k`: a plain client's chat retrieves
            salt,
            fit=config.max_prompt_tokens if config.history == "halve" else None,
        )
    except RequestError as e:
        raise _api_error(e) from None
    return _checked(generator.index, prompt, config)


def completion_prompt(generator: FusedGenerator, request: CompletionRequest, config: ServerConfig, salt: str) -> Prompt:
    """A completion prompt (`request.completion_prompt`, on the engine's thread)."""
    try:
        prompt = build_completion_prompt(generator, request.text, _options(request, config), salt)
    except RequestError as e:
        raise _api_error(e) from None
    return _checked(generator.index, prompt, config)


def _checked(index: KVIndex, prompt: Prompt, config: ServerConfig) -> Prompt:
    """Refuse a prompt over the server's limit, or one that with the tokens it may generate does not
    fit the model's context."""
    n, limit = prompt.n_tokens, index.model.context_length
    if n > config.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {n} tokens, above this server's limit of {config.max_prompt_tokens}",
            param="messages",
            code="context_length_exceeded",
        )
    if n + prompt.generation.max_new_tokens > limit:
        raise APIError(
            400,
            f"the prompt has {n} tokens and up to {prompt.generation.max_new_tokens} more may be "
            f"generated, beyond the model's {limit} positions",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return prompt
