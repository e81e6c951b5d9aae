"""`response_format` on the server's `/v1/chat/completions` ([structured]): the official `openai` client's
`json_schema` and `json_object` formats against a real server on a free loopback port (test_serve's), over
the tiny random-weight Llama with a byte-level BPE tokenizer and ChatML: only the constraint makes its
answers valid JSON. A schema that decoding cannot be constrained to is an OpenAI-style 400.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field, ValidationError
from test_serve import CHATML, KEY, QUESTION, Running, serving

from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.serving.settings import ServerConfig

pytest.importorskip("llguidance")


class Telescope(BaseModel):
    name: str = Field(max_length=16)
    kind: Literal["refractor", "reflector"]
    aperture_cm: int = Field(ge=1, le=1000)


SCHEMA = Telescope.model_json_schema()
MESSAGES = [{"role": "user", "content": QUESTION}]
RAG = {"rag_kvcache": {"top_k": 2}}  # the retrieved chunks' caches fused, as any RAG request


@pytest.fixture(scope="module")
def running(bpe_tiny: ModelAdapter, tmp_path_factory) -> Iterator[Running]:
    chat = copy.deepcopy(bpe_tiny.tokenizer)
    chat.chat_template = CHATML
    adapter = ModelAdapter(bpe_tiny.model, chat, name="tiny-bpe-chat")
    root = tmp_path_factory.mktemp("serve-structured")
    with serving(adapter, root, ServerConfig(api_keys=(KEY,), max_tokens=200)) as running:
        yield running


def test_parse_returns_a_validated_object(running):
    """The client's `parse` sends the Pydantic model as a strict `json_schema` format and validates the answer."""
    client = running.client()
    completion = client.chat.completions.parse(
        model=running.model, messages=MESSAGES, response_format=Telescope, max_tokens=150, extra_body=RAG
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Telescope)
    free = client.chat.completions.create(model=running.model, messages=MESSAGES, max_tokens=60, extra_body=RAG)
    with pytest.raises(ValidationError):  # the same request without the format: the constraint did it
        Telescope.model_validate_json(free.choices[0].message.content)


def test_json_schema_plain_and_streamed(running):
    client = running.client()
    schema_format = {"type": "json_schema", "json_schema": {"name": "telescope", "schema": SCHEMA}}
    whole = client.chat.completions.create(
        model=running.model, messages=MESSAGES, max_tokens=150, response_format=schema_format, extra_body=RAG
    )
    streamed = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=150,
        response_format=schema_format,
        extra_body=RAG,
        stream=True,
    )
    pieces = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    Telescope.model_validate_json(whole.choices[0].message.content)
    assert pieces == whole.choices[0].message.content  # greedy: the stream is the same answer


def test_json_object_answers_only_objects(running):
    """`json_object` allows any object, which a random model may fill without end: every answer begins one,
    and every answer that ends (sampled, several seeds) is one."""
    answers = [
        running.client()
        .chat.completions.create(
            model=running.model,
            messages=MESSAGES,
            max_tokens=150,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_object"},
        )
        .choices[0]
        for seed in range(4)
    ]
    assert all(a.message.content.startswith("{") for a in answers)
    ended = [a.message.content for a in answers if a.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
            "invalid response_format: cannot constrain decoding to JSON Schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}},
            "response_format.json_schema.schema: Input should be a valid dictionary",
        ),
        ({"type": "json_schema"}, "json_schema is required with type 'json_schema'"),
        ({"type": "xml"}, "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "grammar": "g"}},
            "unknown field 'response_format.json_schema.grammar'",
        ),
        # self-referential, matching no finite document: llguidance took them and the answer was a 200
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}, "matches no JSON document"),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
                },
            },
            "matches no JSON document",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
            },
            "matches no JSON document",
        ),
    ],
)
def test_bad_formats_are_openai_400s(running, response_format, message):
    with pytest.raises(openai.BadRequestError) as caught:
        running.client().chat.completions.create(
            model=running.model, messages=MESSAGES, max_tokens=8, response_format=response_format
        )
    error = caught.value.body
    assert message in error["message"] and error["param"].startswith("response_format"), error
    assert error["type"] == "invalid_request_error"


def test_a_recursive_schema_with_a_way_out_is_answered(running):
    """A schema that refers to itself but allows a finite document (a linked list ending in null) is served."""
    node = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    }
    got = running.client().chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "node", "schema": node}},
    )
    assert got.choices[0].message.content.startswith('{"next":')


def test_without_the_extra_the_format_is_refused_naming_it(running, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # not importable, as where [structured] is not installed
    with pytest.raises(openai.BadRequestError) as caught:
        running.client().chat.completions.create(
            model=running.model, messages=MESSAGES, max_tokens=8, response_format={"type": "json_object"}
        )
    error = caught.value.body
    assert "pip install 'rag-kvcache[structured]'" in error["message"]
    assert (error["param"], error["code"]) == ("response_format", "unsupported_response_format")
