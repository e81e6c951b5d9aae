"""`rag_kvcache.query.request`: the one place a front end's request becomes a prompt. What it builds is what the
generator's own layout functions build; every refusal is a `RequestError` naming the parameter at fault."""

from __future__ import annotations

import copy
import logging

import pytest
from test_faults import CFG, QUESTION, write_docs
from test_serve import CHATML
from tiny_model import tiny_llama

from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.prompt import ChatTurn
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.query.request import Options, RequestError, chat_prompt, completion_prompt


@pytest.fixture(scope="module")
def generator(tokenizer, tmp_path_factory) -> FusedGenerator:
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHATML
    adapter = ModelAdapter(tiny_llama(), chat, name="tiny-chat")
    root = tmp_path_factory.mktemp("request")
    return FusedGenerator(
        KVIndex.build(write_docs(root / "docs", 3), root / "index", CFG, adapter=adapter, progress=False)
    )


def test_a_chat_with_chunks_named_is_the_generators_chat_layout(generator):
    index = generator.index
    records = [hit.chunk for hit in index.search(QUESTION, 2)]
    turns = [ChatTurn("system", ("Be brief.",)), ChatTurn("user", (QUESTION,))]
    prompt = chat_prompt(
        generator,
        turns,
        Options(chunk_ids=[r.id for r in records], fusion={"method": "epic"}, max_tokens=5, temperature=0.0),
    )
    assert prompt.segments == generator.layout.chat_segments(turns, records, prompt.fusion)
    assert prompt.fusion.method == "epic" and prompt.generation.max_new_tokens == 5
    assert [c["id"] for c in prompt.chunks] == [r.id for r in records] and all(
        c["score"] is None for c in prompt.chunks
    )


def test_a_completion_with_chunks_retrieved_is_asks_layout(generator):
    """Chunks retrieved go in the index's chunk order (by default the best last, next to the question), as
    `ask` lays them out; the response lists them best first. Chunks named keep the order they are named in."""
    index = generator.index
    prompt = completion_prompt(generator, QUESTION, Options(top_k=2))
    hits = index.search(QUESTION, 2)
    question = index.format.question_ids(index.adapter.tokenizer, QUESTION)
    assert index.config.query.chunk_order == "best_last"
    assert prompt.segments == index.format.segments([h.chunk.token_ids for h in hits[::-1]], question)
    assert [c["score"] for c in prompt.chunks] == [pytest.approx(float(h.score)) for h in hits]
    assert prompt.generation == index.config.query.generation  # nothing asked: the index's settings
    named = completion_prompt(generator, QUESTION, Options(chunk_ids=[h.chunk.id for h in hits]))
    assert named.segments == index.format.segments([h.chunk.token_ids for h in hits], question)


def test_a_deployments_cap_is_the_default_and_the_most(generator):
    defaults = generator.index.config.query.generation.max_new_tokens
    turns = [ChatTurn("user", (QUESTION,))]
    assert chat_prompt(generator, turns, Options(max_tokens_limit=3)).generation.max_new_tokens == min(3, defaults)
    with pytest.raises(RequestError, match="above this server's limit of 3") as refused:
        chat_prompt(generator, turns, Options(max_tokens=4, max_tokens_limit=3))
    assert (refused.value.param, refused.value.code) == ("max_tokens", "max_tokens_exceeded")


def test_a_chat_over_the_fit_drops_its_oldest_turns(generator):
    turns = [
        ChatTurn(role, (f"{role} message {i}: " + "words " * 30,)) for i in range(6) for role in ("user", "assistant")
    ]
    turns.append(ChatTurn("user", (QUESTION,)))
    whole = chat_prompt(generator, turns)
    fitted = chat_prompt(generator, turns, fit=whole.n_tokens // 2)
    assert fitted.dropped > 0 and fitted.n_tokens <= whole.n_tokens // 2


def test_a_chat_quoting_no_chunk_is_warned_about_once(generator, caplog):
    """Fitting a chat lays out several cuts before it answers one: the warning that a method reading caches
    found no indexed text is logged once, for the prompt that is answered."""
    turns = [
        ChatTurn(role, (f"{role} message {i}: " + "words " * 30,)) for i in range(6) for role in ("user", "assistant")
    ]
    turns.append(ChatTurn("user", ("Say something.",)))
    cacheblend = Options(fusion={"method": "cacheblend"})
    whole = chat_prompt(generator, turns, cacheblend)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rag_kvcache"):
        fitted = chat_prompt(generator, turns, cacheblend, fit=whole.n_tokens // 2)
    assert fitted.dropped > 0
    assert caplog.text.count("found no indexed text") == 1


@pytest.mark.parametrize(
    "build,options,param,code",
    [
        ("chat", Options(chunk_ids=["0123456789abcdef"]), "chunk_ids", "unknown_chunk"),
        ("chat", Options(fusion={"method": "nonesuch"}), "method", "invalid_method"),
        ("chat", Options(fusion={"ratio": 7.0}), "fusion", None),
        ("chat", Options(fusion={"no_such_field": 1}), "fusion", None),
        ("chat", Options(max_tokens=0), "max_tokens", None),
        ("chat", Options(json_schema="{not json"), "response_format", None),
        ("empty_user", Options(top_k=2), "top_k", None),
        ("no_user", None, "messages", None),  # a chunk named, and no user message to put it in
        ("empty_completion", Options(), "prompt", None),
    ],
)
def test_a_bad_request_is_refused_naming_the_parameter(generator, build, options, param, code):
    with pytest.raises(RequestError) as refused:
        if build == "empty_completion":
            completion_prompt(generator, "   ", options)
        elif build == "no_user":
            some = generator.index.search(QUESTION, 1)[0].chunk.id
            chat_prompt(generator, [ChatTurn("assistant", ("hello",))], Options(chunk_ids=[some]))
        else:
            chat_prompt(generator, [ChatTurn("user", ("" if build == "empty_user" else QUESTION,))], options)
    assert (refused.value.param, refused.value.code) == (param, code), str(refused.value)
