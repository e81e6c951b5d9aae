"""A chat through `serve` with the `openai` client: each turn reads the turns before it from the
conversation cache (`usage.prompt_tokens_details.cached_tokens`, the `rag_kvcache` field, `/metrics`),
an exact method answers as the same messages sent to a server without one, and a conversation is its
API key's alone."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest
from test_serve import ADMIN, KEY, Running, chat_adapter, sample, serving  # noqa: F401

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.serving.settings import ServerConfig

OTHER = "other-key"
QUESTIONS = (
    "What is the telescope of the Veldmark Observatory named?",
    "What kind of telescope is it?",
    "Who kept a diary?",
    "When was the lighthouse lit?",
)


@pytest.fixture(scope="module")
def chatting(chat_adapter, tmp_path_factory) -> Iterator[Running]:  # noqa: F811
    root = tmp_path_factory.mktemp("chat")
    config = ServerConfig(api_keys=(KEY, OTHER), admin_keys=(ADMIN,), max_prompt_tokens=1000)
    with serving(chat_adapter, root, config, conversation_bytes=64 << 20) as running:
        yield running


def client(running: Running, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0)


def converse(running: Running, method: str, key: str = KEY, salt: str | None = None) -> list:
    """The chat of QUESTIONS, each answer appended before the next question; the responses."""
    messages, responses = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        extra = {"rag_kvcache": {"method": method}} | ({"cache_salt": salt} if salt else {})
        r = client(running, key).chat.completions.create(
            model=running.model, messages=messages, max_tokens=5, temperature=0, extra_body=extra
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        responses.append(r)
    return responses


def ask_next(talk: openai.OpenAI, model: str, messages: list[dict], i: int, extra: dict):
    """Question `i` (of QUESTIONS, numbered) appended to `messages` and asked; its answer appended; the response."""
    messages.append({"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i + 1})"})
    r = talk.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, extra_body=extra)
    messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def alone(running: Running, messages: list[dict], method: str) -> str:
    """The answer to `messages` fused without a conversation cache, on the server's engine."""
    gen = FusedGenerator(running.engine.index)
    return running.engine.run(
        lambda: gen.complete(
            messages, fusion=FusionConfig(method=method), generation=GenerationConfig(max_new_tokens=5)
        )
    ).answer


@pytest.mark.parametrize("method", ["full", "prefix"])
def test_an_exact_methods_chat_reads_earlier_turns_and_answers_as_without_them(chatting, method):
    responses = converse(chatting, method, salt=f"exact-{method}")
    messages = []
    for i, (question, r) in enumerate(zip(QUESTIONS, responses)):
        messages.append({"role": "user", "content": question})
        assert r.choices[0].message.content == alone(chatting, messages, method), f"turn {i + 1}"
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        read = r.model_extra["rag_kvcache"]["conversation_tokens"]
        if i:  # the previous prompt and the answer tokens fed back (all but the last) come from the cache
            before = responses[i - 1].usage
            assert read >= before.prompt_tokens + before.completion_tokens - 1, f"turn {i + 1}"
            assert r.usage.prompt_tokens_details.cached_tokens >= read
    last = responses[-1].usage
    assert last.prompt_tokens_details.cached_tokens / last.prompt_tokens > 0.75  # 4 short turns; more at 10


def test_a_conversation_is_its_api_keys_alone(chatting):
    mine = converse(chatting, "cacheblend", salt="tenancy")
    theirs = converse(chatting, "cacheblend", key=OTHER, salt="tenancy")
    assert mine[0].model_extra["rag_kvcache"]["conversation_tokens"] == 0
    assert mine[1].model_extra["rag_kvcache"]["conversation_tokens"] > 0
    assert theirs[0].model_extra["rag_kvcache"]["conversation_tokens"] == 0  # the same messages, another key
    again = converse(chatting, "cacheblend", salt="tenancy")  # the first turn again: now a stored prompt
    assert again[0].model_extra["rag_kvcache"]["conversation_tokens"] == again[0].usage.prompt_tokens - 1


def test_metrics_show_the_conversation_cache(chatting):
    converse(chatting, "reuse", salt="metrics")
    assert chatting.metric("rag_kvcache_conversation_cache_bytes") > 0
    assert chatting.metric("rag_kvcache_conversation_cache_max_bytes") == 64 << 20
    assert chatting.metric("rag_kvcache_conversation_cache_hit_tokens_total") > 0


def test_a_chat_over_the_limit_drops_its_oldest_messages_once_and_the_next_turns_read_it(chatting):
    """A chat that outgrows the prompt limit drops its oldest messages in one step down to half the limit
    (not one message a turn, which would change the prompt's start every turn); the next turns keep that
    cut, reading the shortened chat from the conversation cache, until it fills the limit again. With
    history="refuse" it is a 400."""
    from test_serve import start_server, stop_server

    from rag_kvcache.serving.openai_api import create_app

    config = ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), max_prompt_tokens=260)
    server, thread, url = start_server(create_app(chatting.engine, config))
    refusing, rthread, rurl = start_server(create_app(chatting.engine, replace(config, history="refuse")))
    try:
        talk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        messages, turns = [], []
        for i in range(12):
            r = ask_next(talk, chatting.model, messages, i, {"cache_salt": "halving"})
            turns.append(
                (
                    r.usage.prompt_tokens,
                    r.model_extra["rag_kvcache"]["dropped_messages"],
                    r.model_extra["rag_kvcache"]["conversation_tokens"],
                )
            )
        with pytest.raises(openai.BadRequestError, match="context_length_exceeded|over the"):
            openai.OpenAI(base_url=f"{rurl}/v1", api_key=KEY, max_retries=0).chat.completions.create(
                model=chatting.model, messages=messages, max_tokens=5
            )
    finally:
        stop_server(server, thread)
        stop_server(refusing, rthread)
    assert all(n <= 260 for n, _, _ in turns), turns
    first = next(i for i, (_, dropped, _) in enumerate(turns) if dropped)
    for n, dropped, read in turns[first:]:
        # the cut an earlier turn made, or the one prepared while the server was idle (whichever of the next
        # request and that task reached the engine first): the chat so far is read from the cache; else a
        # new cut, in one step, down to half the limit
        assert read >= n / 2 or n <= 130, turns
    assert len({dropped for _, dropped, _ in turns[first:]}) <= (len(turns) - first + 1) // 2, turns  # each cut lasts


def test_the_turn_that_outgrows_the_limit_reads_the_history_prepared_while_idle(chatting):
    """After each answer the server prepares, while idle, the shortened chat a turn over the limit will be cut
    to; that turn reads it from the conversation cache instead of computing it, and with an exact method its
    answer equals the kept messages' answered without any cache."""
    from test_serve import start_server, stop_server

    from rag_kvcache.serving.openai_api import create_app

    config = ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), max_prompt_tokens=260)
    server, thread, url = start_server(create_app(chatting.engine, config))
    running = replace(chatting, url=url)
    try:
        messages, turns = [], []
        for i in range(12):
            r = ask_next(
                client(running),
                chatting.model,
                messages,
                i,
                {"cache_salt": "prepared", "rag_kvcache": {"method": "full"}},
            )
            extension = r.model_extra["rag_kvcache"]
            turns.append((r.usage.prompt_tokens, extension["dropped_messages"], extension["conversation_tokens"]))
            deadline = time.monotonic() + 60  # this answer's background task done before the next turn is sent
            while running.metric("rag_kvcache_background_tasks_total", outcome="done") < i + 1:
                assert time.monotonic() < deadline, "the background task did not run"
                time.sleep(0.05)
            if len({d for _, d, _ in turns}) > 2:  # a second cut: the first came after a preparation too
                break
    finally:
        stop_server(server, thread)
    cuts = [i for i in range(1, len(turns)) if turns[i][1] != turns[i - 1][1]]
    assert cuts, turns
    for i in cuts:
        n, dropped, read = turns[i]
        assert n <= 260 and read >= n / 2, turns  # the dropped-to history came from the cache, prepared
        kept = messages[dropped : 2 * i + 1]  # the messages the prompt held, up to this turn's question
        assert alone(running, kept, "full") == messages[2 * i + 1]["content"]


def test_a_chat_that_retrieves_chunks_every_turn_reads_its_earlier_turns(chatting):
    """With chunks retrieved for each question (at the head of the last user message), the turns before them
    are a new head of request text every turn: they are read from the conversation cache, not computed as a
    head of their own."""
    messages, reads = [], []
    for i in range(5):
        extra = {"cache_salt": "retrieving-each-turn", "rag_kvcache": {"top_k": 3}}
        r = ask_next(client(chatting), chatting.model, messages, i, extra)
        assert len(r.model_extra["rag_kvcache"]["chunks"]) == 3
        reads.append(r.model_extra["rag_kvcache"]["conversation_tokens"])
    assert all(n > 0 for n in reads[2:]), reads  # from the third turn the history before the last turn is held


# ---- tenants: budgets and numbers of their own ------------------------------------------------------------
@pytest.fixture(scope="module")
def tenants(chat_adapter, tmp_path_factory) -> Iterator[Running]:  # noqa: F811
    root = tmp_path_factory.mktemp("tenants")
    config = ServerConfig(api_keys=(KEY, OTHER), admin_keys=(ADMIN,), max_prompt_tokens=1000)
    with serving(chat_adapter, root, config, conversation_bytes=64 << 20) as running:
        yield running


def tenant_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def page(running: Running, key: str) -> str:
    r = httpx.get(f"{running.url}/metrics", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.text


def chat_turn(running: Running, key: str, question: str, salt: str | None = None):
    extra = {"rag_kvcache": {"method": "reuse"}} | ({"cache_salt": salt} if salt else {})
    return client(running, key).chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": question}],
        max_tokens=5,
        temperature=0,
        extra_body=extra,
    )


def test_one_tenants_chats_never_evict_anothers(tenants):
    """One global budget once let two of tenant B's chats evict tenant A's: each tenant now has the budget to
    itself, and B's chats (with any cache_salt) evict only B's."""
    conversations = tenants.engine.generator.conversations
    first = chat_turn(tenants, KEY, QUESTIONS[0])
    held = conversations.stats_of(tenant_id(KEY)).bytes
    assert held > 0
    conversations.max_bytes = held * 3 // 2  # room for one such chat per tenant, not two
    try:
        for i, salt in enumerate((None, "second", "third")):
            chat_turn(tenants, OTHER, f"{QUESTIONS[1 + i]} Tell me now.", salt)
        theirs = conversations.stats_of(tenant_id(OTHER))
        assert theirs.evicted_tokens > 0 and theirs.bytes <= conversations.max_bytes
        assert conversations.stats_of(tenant_id(KEY)).evicted_tokens == 0
        again = chat_turn(tenants, KEY, QUESTIONS[0])  # tenant A's stored prompt: read, not recomputed
        assert again.model_extra["rag_kvcache"]["conversation_tokens"] == first.usage.prompt_tokens - 1
    finally:
        conversations.max_bytes = 64 << 20


def test_a_key_sees_its_own_numbers_and_an_admin_key_everyones(tenants):
    """/metrics once showed every tenant's conversation hits and request counts to any key."""
    route = {"route": "/v1/chat/completions", "status": "200"}
    before = {key: sample(page(tenants, key), "rag_kvcache_requests_total", **route) for key in (KEY, OTHER)}
    chat_turn(tenants, KEY, QUESTIONS[2], salt="mine")
    chat_turn(tenants, KEY, QUESTIONS[2], salt="mine")  # a hit
    for _ in range(3):
        chat_turn(tenants, OTHER, QUESTIONS[3], salt="theirs")
    conversations = tenants.engine.generator.conversations
    mine, theirs, admin = page(tenants, KEY), page(tenants, OTHER), page(tenants, ADMIN)
    assert sample(mine, "rag_kvcache_requests_total", **route) - before[KEY] == 2
    assert sample(theirs, "rag_kvcache_requests_total", **route) - before[OTHER] == 3
    for text, key in ((mine, KEY), (theirs, OTHER)):
        own = conversations.stats_of(tenant_id(key))
        assert sample(text, "rag_kvcache_conversation_cache_hits_total") == own.hits
        assert sample(text, "rag_kvcache_conversation_cache_bytes") == own.bytes
        assert "rag_kvcache_kv_cache_hits_total" not in text and "tenant=" not in text  # no server-wide series
    total = conversations.stats
    assert sample(admin, "rag_kvcache_conversation_cache_hits_total") == total.hits
    assert sample(admin, "rag_kvcache_requests_total", **route) == sample(
        mine, "rag_kvcache_requests_total", **route
    ) + sample(theirs, "rag_kvcache_requests_total", **route)
    for key in (KEY, OTHER):
        held = sample(admin, "rag_kvcache_tenant_conversation_cache_bytes", tenant=tenant_id(key))
        assert held == conversations.stats_of(tenant_id(key)).bytes > 0
    assert "rag_kvcache_kv_cache_hits_total" in admin
