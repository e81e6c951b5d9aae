"""What a LangChain user expects of a chat model (issue 15): token counts by the index's own tokenizer,
offline; per-call settings; structured output decoded under the schema; standard parameters; device/dtype."""

from __future__ import annotations

import pytest
import torch
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_rag_kvcache import ChatRagKVCache, RagKVCacheGrader, RagKVCacheRetriever
from pydantic import ValidationError

from rag_kvcache import ServingEngine

from ...testing import Telescope

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M


@pytest.fixture(scope="module")
def model(demo_engine: ServingEngine) -> ChatRagKVCache:
    return ChatRagKVCache(engine=demo_engine, max_tokens=48)


def test_token_counts_use_the_index_tokenizer(
    model: ChatRagKVCache, demo_engine: ServingEngine, rag_question: HumanMessage
) -> None:
    """No GPT-2 tokenizer download (it took 5 minutes of network errors offline, then counted 0)."""
    tokenizer = demo_engine.index.adapter.tokenizer
    assert model.get_token_ids("Veldmark Observatory") == tokenizer.encode(
        "Veldmark Observatory", add_special_tokens=False
    )
    assert model.get_num_tokens("Veldmark Observatory") == len(model.get_token_ids("Veldmark Observatory")) > 0
    messages = [SystemMessage("Answer briefly."), rag_question]
    answer = model.invoke(messages, max_tokens=2)
    assert model.get_num_tokens_from_messages(messages) == answer.usage_metadata["input_tokens"]
    with pytest.raises(ValueError, match="no tool calling"):
        model.get_num_tokens_from_messages(messages, tools=[{"name": "add"}])


def test_per_call_settings(model: ChatRagKVCache, rag_question: HumanMessage) -> None:
    assert model.invoke([rag_question], max_tokens=3).usage_metadata["output_tokens"] <= 3
    full = model.invoke([rag_question]).text
    cut = full.split()[1]
    assert cut not in model.invoke([rag_question], stop=[cut]).text
    assert model.bind(stop=[cut]).invoke([rag_question]).text == model.invoke([rag_question], stop=[cut]).text
    sampled = [model.invoke([rag_question], temperature=1.5, seed=seed, max_tokens=12).text for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[2] != sampled[0]  # seeded sampling, per call
    with pytest.raises(TypeError, match="top_k"):
        model.invoke([rag_question], top_k=3)


def test_structured_output_is_decoded_under_the_schema(model: ChatRagKVCache, rag_question: HumanMessage) -> None:
    telescope = model.with_structured_output(Telescope).invoke([rag_question])
    assert isinstance(telescope, Telescope) and telescope.name and telescope.observatory  # what it says is the model's
    as_dict = model.with_structured_output(Telescope.model_json_schema(), method="json_mode").invoke([rag_question])
    assert as_dict.keys() == {"name", "observatory"}
    raw = model.with_structured_output(Telescope, include_raw=True).invoke([rag_question])
    assert raw["parsed"] == telescope and raw["parsing_error"] is None
    assert raw["raw"].usage_metadata["input_token_details"]["cache_read"] > 0  # the chunks still come from cache
    streamed = list(model.with_structured_output(Telescope).stream([rag_question]))
    assert streamed and streamed[-1] == telescope


def test_structured_output_cut_short_fails_loudly(
    demo_engine: ServingEngine, model: ChatRagKVCache, rag_question: HumanMessage
) -> None:
    """An answer that runs out of tokens before its JSON closes is refused, never returned half-built."""
    with pytest.raises(OutputParserException):
        ChatRagKVCache(engine=demo_engine, max_tokens=4).with_structured_output(Telescope).invoke([rag_question])
    with pytest.raises(ValueError, match="response_format must be"):
        model.invoke([rag_question], response_format={"type": "xml"})


def test_standard_parameters(demo_engine: ServingEngine, demo_index: str, rag_question: HumanMessage) -> None:
    model = ChatRagKVCache(engine=demo_engine, max_retries=2, timeout=60)
    assert model.invoke([rag_question], max_tokens=2).text
    with pytest.raises(TimeoutError, match="timeout=1e-09"):
        ChatRagKVCache(engine=demo_engine, timeout=1e-9).invoke([rag_question])
    with pytest.raises(ValueError, match="device='cuda'.*already loaded on cpu"):
        ChatRagKVCache(engine=demo_engine, device="cuda")
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16, got 'float8'"):
        ChatRagKVCache(index=demo_index, dtype="float8")


def test_device_and_dtype_choose_how_the_model_loads(demo_index: str) -> None:
    model = ChatRagKVCache(index=demo_index, device="cpu", dtype="bfloat16", max_tokens=4)
    try:
        assert model.invoke("Hello").usage_metadata["output_tokens"] > 0
        loaded = model._handle.get().index.adapter.model
        assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
    finally:
        model.close()


@pytest.mark.parametrize("component", [ChatRagKVCache, RagKVCacheRetriever, RagKVCacheGrader])
def test_an_unknown_argument_is_refused(component, demo_engine: ServingEngine) -> None:
    """The retriever and the grader once took `extra="ignore"` from their LangChain base and dropped a mistyped
    argument (`kk=2`) without a word."""
    with pytest.raises(ValidationError, match="kk"):
        component(engine=demo_engine, kk=2)
