"""The prompt layouts `bench --prompt-style` runs a QA set through.

- `native`: our own segments (`PromptFormat.segments`): the system prefix, the chunks' stored ids
  with separators, the question. Every chunk token is read from its cache by construction.
- `langchain`: the prompt of LangChain's RAG tutorial chain: `format_docs` joins the documents'
  `page_content` with blank lines into the system message of a `ChatPromptTemplate`, the question is
  the human message (the tutorial "Build a Retrieval Augmented Generation (RAG) App: Part 2",
  its `system_prompt`).
- `llamaindex`: what LlamaIndex's default query engine sends a chat model such as `RagKVCacheLLM`:
  the `compact` synthesizer's default text-QA template (`DEFAULT_TEXT_QA_PROMPT_SEL` picks its chat
  form for a chat model: the system message `TEXT_QA_SYSTEM_PROMPT`, then `DEFAULT_TEXT_QA_PROMPT_TMPL`
  as the user message, both from `llama_index.core.prompts`), its context the nodes' stripped texts
  joined with blank lines (`PromptHelper.repack`).

The frameworks' layouts are rebuilt here as plain chat messages (the core package imports neither
framework; a test checks them against the frameworks' own templates). The fused generator renders
them through the model's chat template, tokenises them whole and finds the chunks in them by their
token ids, as it does for any pipeline's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

PROMPT_STYLES = ("native", "langchain", "llamaindex")
NATIVE = "native"

# LangChain's RAG tutorial (part 2), `system_prompt`, with `{context}` the documents joined by `format_docs`.
LANGCHAIN_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep the "
    "answer concise.\n\n{context}"
)
# llama_index.core.prompts.chat_prompts.TEXT_QA_SYSTEM_PROMPT's content.
LLAMAINDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\nAlways answer the query using the provided "
    "context information, and not prior knowledge.\nSome rules to follow:\n1. Never directly reference the given "
    "context in your answer.\n2. Avoid statements like 'Based on the context, ...' or 'The context information "
    "...' or anything along those lines."
)
# llama_index.core.prompts.default_prompts.DEFAULT_TEXT_QA_PROMPT_TMPL.
LLAMAINDEX_QA = (
    "Context information is below.\n---------------------\n{context_str}\n---------------------\nGiven the context "
    "information and not prior knowledge, answer the query.\nQuery: {query_str}\nAnswer: "
)


def style_messages(style: str, texts: Sequence[str], question: str) -> list[dict[str, str]]:
    """The chat messages a pipeline of `style` sends for `question` over the retrieved `texts`."""
    if style == "langchain":
        return [
            {"role": "system", "content": LANGCHAIN_SYSTEM.format(context="\n\n".join(texts))},
            {"role": "user", "content": question},
        ]
    if style == "llamaindex":
        context = "\n\n".join(t.strip() for t in texts if t.strip())
        return [
            {"role": "system", "content": LLAMAINDEX_SYSTEM},
            {"role": "user", "content": LLAMAINDEX_QA.format(context_str=context, query_str=question)},
        ]
    raise ValueError(f"prompt style {style!r} has no messages of its own; styles: {', '.join(PROMPT_STYLES)}")
