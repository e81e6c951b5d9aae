"""Answers constrained to a JSON Schema (`GenerationConfig.json_schema`, llguidance): even a random-weight
model can only produce JSON that matches the schema."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from rag_kvcache.config import GenerationConfig
from rag_kvcache.engine.constraints import _closed
from rag_kvcache.engine.generation import Decoder
from rag_kvcache.engine.model import ModelAdapter

pytest.importorskip("llguidance")


class Reading(BaseModel):
    station: str = Field(max_length=12)
    kind: Literal["rain", "wind", "snow"]
    value: int = Field(ge=-50, le=500)
    flags: list[bool] = Field(max_length=3)
    note: str | None = Field(default=None, max_length=8)


SCHEMA = json.dumps(Reading.model_json_schema())


def decode(adapter: ModelAdapter, cfg: GenerationConfig, seed: int) -> tuple[str, int]:
    """(text, tokens) decoded after a random 12-token prompt."""
    ids = torch.randint(0, len(adapter.tokenizer) - 1, (1, 12), generator=torch.Generator().manual_seed(seed))
    keys, values, logits = adapter.prefill(ids)
    decoder = Decoder(adapter, cfg)
    steps = list(decoder.steps(keys, values, logits[0], decoder.sample(logits[0])))
    return "".join(s.text for s in steps), sum(s.token_id is not None for s in steps)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_decode_only_json_that_matches_the_schema(bpe_tiny: ModelAdapter, temperature: float) -> None:
    cfg = GenerationConfig(max_new_tokens=200, temperature=temperature, seed=7, json_schema=SCHEMA)
    for seed in range(4):
        text, n = decode(bpe_tiny, cfg, seed)
        assert n < cfg.max_new_tokens  # it ended on end of sequence, the document complete
        Reading.model_validate_json(text)  # raises unless valid against the schema
        assert json.loads(text).keys() <= Reading.model_fields.keys()  # no key the schema does not list


def test_unconstrained_random_weights_produce_no_such_json(bpe_tiny: ModelAdapter) -> None:
    """What the constraint changes: the same model and prompts without it write no valid document."""
    for seed in range(4):
        text, _ = decode(bpe_tiny, GenerationConfig(max_new_tokens=60), seed)
        with pytest.raises(ValidationError):
            Reading.model_validate_json(text)


def test_a_token_outside_the_grammar_is_refused(bpe_tiny: ModelAdapter) -> None:
    """A first token chosen without the constraint (`sample_token` instead of `Decoder.sample`) that
    cannot begin the document fails loudly instead of yielding invalid JSON."""
    ids = torch.tensor([[5, 6, 7]])
    keys, values, logits = bpe_tiny.prefill(ids)
    decoder = Decoder(bpe_tiny, GenerationConfig(json_schema=SCHEMA))
    not_a_brace = bpe_tiny.tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(ValueError, match=f"token {not_a_brace} does not continue the JSON Schema"):
        list(decoder.steps(keys, values, logits[0], not_a_brace))


def test_a_wordpiece_tokenizer_is_refused_clearly(tiny: ModelAdapter) -> None:
    with pytest.raises(ValueError, match="need a byte-level or SentencePiece-style fast tokenizer"):
        Decoder(tiny, GenerationConfig(json_schema=SCHEMA))


def test_a_schema_that_is_not_one_is_refused(bpe_tiny: ModelAdapter) -> None:
    with pytest.raises(ValueError, match="cannot constrain decoding to JSON Schema"):
        Decoder(bpe_tiny, GenerationConfig(json_schema='{"type": "no-such-type"}'))
    with pytest.raises(ValueError, match="json_schema is not JSON"):
        Decoder(bpe_tiny, GenerationConfig(json_schema="{'type': 'object'}"))


@pytest.mark.parametrize("levels", [450, 100_000])
def test_a_schema_nested_too_deeply_is_refused_not_a_recursion_error(bpe_tiny: ModelAdapter, levels: int) -> None:
    """A schema nested 500-900 levels raised RecursionError (a 500 through the server)."""
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels
    with pytest.raises(ValueError, match=r"json_schema nests .* deep; at most 64"):
        Decoder(bpe_tiny, GenerationConfig(json_schema=schema))


def test_objects_are_closed_unless_the_schema_says_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"$ref": "#/$defs/Inner"}, "free": {"type": "object"}},
        "$defs": {
            "Inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "Open": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
        },
    }
    closed = _closed(schema)
    assert closed["additionalProperties"] is False and closed["$defs"]["Inner"]["additionalProperties"] is False
    assert closed["$defs"]["Open"]["additionalProperties"] == {"type": "integer"}  # what the schema says is kept
    assert "additionalProperties" not in closed["properties"]["free"]  # no properties listed: any object


class City(BaseModel):
    city: str
    country: str


@pytest.mark.smollm2
def test_smollm2_answers_a_simple_schema(smollm2: ModelAdapter) -> None:
    messages = [
        {"role": "user", "content": "Which city is the capital of France? Answer with the city and its country."}
    ]
    ids = smollm2.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    keys, values, logits = smollm2.prefill(ids["input_ids"])
    decoder = Decoder(smollm2, GenerationConfig(max_new_tokens=40, json_schema=json.dumps(City.model_json_schema())))
    steps = list(decoder.steps(keys, values, logits[0], decoder.sample(logits[0])))
    answer = City.model_validate_json("".join(s.text for s in steps))
    assert answer.city == "Paris" and answer.country.lower() == "france"
