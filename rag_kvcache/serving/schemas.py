"""Request bodies of the OpenAI-compatible server, validated strictly: an unknown field, a wrong
type or a value out of range is a 400, never a 500 or a silently ignored option.

The fields are those of OpenAI's API that this server honours, plus the few that clients send by
default and that are accepted only at the value that means "off" (`n=1`, no penalties, no
logprobs). `rag_kvcache` (the OpenAI client's `extra_body`) picks the fusion method and its
parameters, and names the chunks to fuse or asks the server to retrieve them. A chat request's
`response_format` (`json_schema` or `json_object`, as OpenAI defines them) becomes the JSON Schema the
answer is decoded under (`GenerationConfig.json_schema`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        """Every string must be Unicode text: JSON's `\\ud800` escapes decode to unpaired surrogates, which no
        tokenizer and no file takes (they were 500s)."""
        todo = [value]
        while todo:
            item = todo.pop()
            if isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("holds an unpaired surrogate (\\ud800-\\udfff): not Unicode text") from None
            elif isinstance(item, (list, tuple)):
                todo.extend(item)
            elif isinstance(item, dict):
                todo.extend(item)
                todo.extend(item.values())
        return value


class RagOptions(Strict):
    """The `rag_kvcache` request field: fusion method and parameters; chunks named or retrieved."""

    method: str | None = None
    ratio: float | Literal["auto"] | None = None
    check_layer: int | None = Field(None, ge=0)
    filter_steps: int | None = Field(None, ge=1)
    deviation: Literal["k", "v"] | None = None
    epic_k: int | None = Field(None, ge=0)
    match_words: int | None = Field(None, ge=1)
    chunk_ids: list[str] | None = Field(None, min_length=1)
    top_k: int | None = Field(None, ge=0, le=64)  # 0: none retrieved, whatever `serve --top-k` says

    @model_validator(mode="after")
    def _one_source_of_chunks(self) -> RagOptions:
        if self.chunk_ids is not None and self.top_k is not None:
            raise ValueError("give chunk_ids (the chunks to fuse) or top_k (retrieve them), not both")
        return self

    def fusion_changes(self) -> dict[str, object]:
        """The `FusionConfig` fields this request sets."""
        names = (
            "method",
            "ratio",
            "check_layer",
            "filter_steps",
            "deviation",
            "epic_k",
            "match_words",
        )
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _some_parts(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        if isinstance(value, list) and not value:
            raise ValueError("a list of content parts must hold at least one part")
        return value

    def text_parts(self) -> list[str]:
        return [self.content] if isinstance(self.content, str) else [part.text for part in self.content]


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: OpenAI's fields; the answer is decoded constrained to `schema`
    (strictly, whatever `strict` says: objects that do not say `additionalProperties` get no other keys)."""

    name: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"json_schema is required with type 'json_schema', and only with it (type {self.type!r})")
        return self

    def schema_text(self) -> str | None:
        """The JSON Schema the answer is decoded under, as JSON text (None: unconstrained)."""
        if self.json_schema is not None:
            return json.dumps(self.json_schema.schema_)
        return json.dumps({"type": "object"}) if self.type == "json_object" else None


class Sampling(Strict):
    """What both completion endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)  # what torch's generator takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: caches of request text apart
    rag_kvcache: RagOptions = RagOptions()

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return value

    @model_validator(mode="after")
    def _supported(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        unsupported = {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logprobs": self.logprobs,
        }
        if given := [name for name, value in unsupported.items() if value]:
            raise ValueError(f"not supported by this server: {', '.join(given)} (n=1, penalties 0, no logprobs)")
        return self

    def stops(self) -> tuple[str, ...] | None:
        return None if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def completion_limit(self) -> int | None:
        return self.max_tokens

    def json_schema(self) -> str | None:
        """The JSON Schema the answer must match (completions have no `response_format`, as OpenAI's)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def json_schema(self) -> str | None:
        return None if self.response_format is None else self.response_format.schema_text()

    @property
    def prompt_field(self) -> str:
        return "messages"

    def prompt_chars(self) -> int:
        return sum(len(part) for m in self.messages for part in m.text_parts())


class CompletionRequest(Sampling):
    prompt: str | list[str]
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("this server answers one prompt per request")
        return value

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def prompt_field(self) -> str:
        return "prompt"

    def prompt_chars(self) -> int:
        return len(self.text)


class RetrieveRequest(Strict):
    query: str = Field(min_length=1)
    top_k: int = Field(4, ge=1, le=64)


class Document(Strict):
    source: str = Field(min_length=1, max_length=255)  # a relative path inside the documents folder
    text: str = Field(min_length=1)


class DocumentsRequest(Strict):
    documents: list[Document] = Field(min_length=1, max_length=256)
