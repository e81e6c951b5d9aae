"""`bench --prompt-style`: the frameworks' prompt layouts, and the benchmark run through each of them
on the tiny Llama (given ChatML's chat template): chunks found in the prompt, fidelity to `full` on
the same prompt."""

from __future__ import annotations

import copy

import pytest
from synthetic import synthetic_multihop
from tiny_model import tiny_llama

from rag_kvcache.bench.prompts import LANGCHAIN_SYSTEM, PROMPT_STYLES, style_messages
from rag_kvcache.bench.runner import run_benchmark
from rag_kvcache.bench.variants import BenchSettings
from rag_kvcache.config import Config, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.model import ModelAdapter

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["  The lighthouse on Tessaly was lit in 1856.\n", "Its keeper Ada Rennick kept a diary."]
QUESTION = "When was the lighthouse lit?"


def test_langchain_layout_is_the_tutorial_chains_prompt() -> None:
    """`format_docs` over the documents into the tutorial's ChatPromptTemplate, rendered by LangChain."""
    prompts = pytest.importorskip("langchain_core.prompts")
    from langchain_core.documents import Document

    template = prompts.ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{question}")])
    format_docs = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731 (the tutorial's)
    messages = template.invoke(
        {"context": format_docs([Document(page_content=t) for t in TEXTS]), "question": QUESTION}
    ).to_messages()
    want = [{"role": {"system": "system", "human": "user"}[m.type], "content": m.content} for m in messages]
    assert style_messages("langchain", TEXTS, QUESTION) == want


def test_llamaindex_layout_is_the_default_text_qa_prompt_for_a_chat_model() -> None:
    """What the default synthesizer's template selector sends a chat model, its context repacked as
    `PromptHelper.repack` joins the nodes' texts."""
    chat_prompts = pytest.importorskip("llama_index.core.prompts.chat_prompts")
    from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL

    assert any(prompt is chat_prompts.CHAT_TEXT_QA_PROMPT for _, prompt in DEFAULT_TEXT_QA_PROMPT_SEL.conditionals)
    context = "\n\n".join(t.strip() for t in TEXTS)
    messages = chat_prompts.CHAT_TEXT_QA_PROMPT.format_messages(context_str=context, query_str=QUESTION)
    want = [{"role": m.role.value, "content": m.content} for m in messages]
    assert style_messages("llamaindex", TEXTS, QUESTION) == want


def test_native_has_no_messages() -> None:
    with pytest.raises(ValueError, match="native"):
        style_messages("native", TEXTS, QUESTION)
    with pytest.raises(ValueError, match="unknown prompt style 'haystack'"):
        BenchSettings(prompt_style="haystack")


@pytest.fixture(scope="module")
def chat_adapter(tokenizer) -> ModelAdapter:
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHATML
    return ModelAdapter(tiny_llama(), chat, name="tiny-chat")


@pytest.mark.parametrize("style", PROMPT_STYLES)
def test_benchmark_through_each_prompt_style(style, chat_adapter, tmp_path) -> None:
    """Each style's prompt finds (nearly) every retrieved chunk token in the cache; `full` on the same
    prompt is the fidelity reference (it scores itself perfectly), and a reusing method computes less."""
    cfg = Config(
        index=IndexSettings(chunk_tokens=48), query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=3))
    )
    settings = BenchSettings(methods=("full", "reuse"), baseline="reuse", warmup=0, prompt_style=style)
    result = run_benchmark(synthetic_multihop(2), tmp_path / "out", cfg, settings, adapter=chat_adapter, progress=False)
    summary = {e["method"]: e for e in result.summary if not e.get("noise_floor")}
    assert result.meta["prompt_style"] == style
    matched = [r["chunk_tokens_matched"] for r in result.records]
    assert all(0.85 <= m <= 1.0 for m in matched), matched
    assert style != "native" or set(matched) == {1.0}
    assert summary["full"]["tf_kl"] == pytest.approx(0.0, abs=1e-6) and summary["full"]["recompute_fraction"] == 1.0
    assert summary["reuse"]["recompute_fraction"] < 0.5
    assert summary["reuse"]["chunk_tokens_matched"] == pytest.approx(sum(matched) / len(matched))
    assert all(r["chunks"] for r in result.records)
    assert "Chunk tokens matched" in (tmp_path / "out" / "results.md").read_text()
