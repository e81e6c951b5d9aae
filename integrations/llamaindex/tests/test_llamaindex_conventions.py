"""What a LlamaIndex user expects of an LLM (issue 15): token counting with the index's own tokenizer and
the usage in `raw`; per-call settings; `structured_predict` decoded under the schema; device/dtype."""

from __future__ import annotations

import pytest
import torch
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.rag_kvcache import RagKVCacheLLM
from llama_index.retrievers.rag_kvcache import RagKVCacheRetriever

from rag_kvcache import ServingEngine

from ...testing import Telescope
from .support import QUESTION

pytestmark = pytest.mark.smollm2  # every test runs on the demo index built with SmolLM2-135M


@pytest.fixture(scope="module")
def llm(demo_engine: ServingEngine) -> RagKVCacheLLM:
    return RagKVCacheLLM(engine=demo_engine, max_tokens=48)


def test_token_counting_handler_reads_the_usage(demo_engine: ServingEngine, chunk_ids: list[str]) -> None:
    counter = TokenCountingHandler(tokenizer=RagKVCacheLLM(engine=demo_engine).tokenizer)
    llm = RagKVCacheLLM(engine=demo_engine, max_tokens=8, callback_manager=CallbackManager([counter]))
    completion = llm.complete(QUESTION, chunk_ids=chunk_ids)
    usage = completion.raw["usage"]
    assert usage["cached_tokens"] > usage["prompt_tokens"] // 2
    assert (counter.prompt_llm_token_count, counter.completion_llm_token_count) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    counter.reset_counts()
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content="Hello")])
    assert counter.prompt_llm_token_count == chat.raw["usage"]["prompt_tokens"] > 0
    counter.reset_counts()
    *_, last = llm.stream_complete(QUESTION, chunk_ids=chunk_ids)
    assert counter.total_llm_token_count == last.raw["usage"]["total_tokens"] == usage["total_tokens"]
    tokenizer = demo_engine.index.adapter.tokenizer
    assert llm.tokenizer("Veldmark") == tokenizer.encode("Veldmark", add_special_tokens=False)


def test_per_call_settings(llm: RagKVCacheLLM, chunk_ids: list[str]) -> None:
    assert llm.complete(QUESTION, chunk_ids=chunk_ids, max_tokens=3).raw["usage"]["completion_tokens"] <= 3
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content="Hi")], max_tokens=2)
    assert chat.raw["usage"]["completion_tokens"] <= 2
    sampled = [llm.complete("Hi", temperature=0.9, seed=seed, max_tokens=12).text for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[2] != sampled[0]
    full = llm.complete(QUESTION, chunk_ids=chunk_ids).text
    cut = full.split()[1]
    assert cut not in llm.complete(QUESTION, chunk_ids=chunk_ids, stop=[cut]).text


def test_structured_predict_returns_validated_objects(
    llm: RagKVCacheLLM, chunk_ids: list[str], demo_engine: ServingEngine
) -> None:
    context = "\n\n".join(r.text for r in demo_engine.run(demo_engine.index.chunks.get, chunk_ids))
    prompt = PromptTemplate("{context}\n\nWhich telescope is the main telescope of the Veldmark Observatory?")
    telescope = llm.structured_predict(Telescope, prompt, context=context)
    assert isinstance(telescope, Telescope) and telescope.name and telescope.observatory  # what it says is the model's
    *_, last = llm.stream_structured_predict(Telescope, prompt, context=context)
    assert last == telescope


async def test_async_structured_predict(llm: RagKVCacheLLM) -> None:
    prompt = PromptTemplate("Which city is the capital of {country}? Give the city and the country.")
    city = await llm.astructured_predict(Telescope, prompt, country="France")  # any schema: its shape is kept
    assert isinstance(city, Telescope)


def test_standard_parameters_and_device(demo_engine: ServingEngine, demo_index: str) -> None:
    assert RagKVCacheLLM(engine=demo_engine, max_retries=2, timeout=60, max_tokens=2).complete("Hi").text
    with pytest.raises(TimeoutError, match="timeout=1e-09"):
        RagKVCacheLLM(engine=demo_engine, timeout=1e-9).complete("Hi")
    with pytest.raises(ValueError, match="already loaded on cpu"):
        RagKVCacheLLM(engine=demo_engine, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        RagKVCacheRetriever(demo_index, dtype="half")
    llm = RagKVCacheLLM(index=demo_index, device="cpu", dtype="bfloat16", max_tokens=4)
    try:
        assert llm.complete("Hi").raw["usage"]["completion_tokens"] > 0
        model = llm.serving_engine.index.adapter.model
        assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    finally:
        llm.close()
