"""`rag-kvcache serve` on the tiny Llama: a real uvicorn server on a free loopback port, driven by
the official `openai` client, LangChain's `ChatOpenAI`, LlamaIndex's `OpenAILike` and raw httpx.

Answers are compared with the engine's own (`ask` / `ServingEngine.stream`) for the same prompt and method.
The tiny model's tokenizer has no chat template; the tests give a copy of it ChatML's.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from tiny_model import tiny_llama

from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.generation import Decoder, sample_token
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.prompt import ChatTurn, ChunkPart, Segment, chat_segments
from rag_kvcache.errors import ConfigError
from rag_kvcache.index import KVIndex
from rag_kvcache.query.answers import Answer
from rag_kvcache.serving.engine import ServingEngine
from rag_kvcache.serving.metrics import ServerMetrics
from rag_kvcache.serving.openai_api import create_app
from rag_kvcache.serving.scheduler import Scheduler
from rag_kvcache.serving.settings import ServerConfig

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DOCS = {
    "lighthouse.txt": "The lighthouse on Tessaly was lit in 1856. Its keeper Ada Rennick kept a diary of ships. " * 3,
    "observatory.txt": "The main telescope of the Veldmark Observatory is named Harrow's Eye. It is a refractor. " * 3,
    "bakery.txt": "Saltmere's bakery sells a dark rye loaf with caraway seeds every market day. " * 3,
}
CFG = Config(  # 24-token chunks behind the prefix: the first retrieved is exact, the prompt mostly cached
    index=IndexSettings(chunk_tokens=24, chunk_prefill="behind_prefix"),
    query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=6)),
)
KEY = "test-key"
ADMIN = "admin-key"  # may change the documents
QUESTION = "What is the telescope of the Veldmark Observatory named?"
LONG = 600  # tokens: a generation long enough to be interrupted


@dataclass
class Running:
    url: str
    engine: ServingEngine
    docs: Path
    model: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)

    def metrics(self) -> str:
        """The server's /metrics page as an admin key sees it (the whole server's): one snapshot of every series."""
        return httpx.get(f"{self.url}/metrics", headers=self.admin_headers()).text

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.metrics(), name, **labels)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()


def sample(page: str, name: str, **labels: str) -> float:
    """The value of series `name` with exactly `labels` on a /metrics `page` (0 where the server has none yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
    found = re.search(pattern, page, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def start_server(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """uvicorn on a free 127.0.0.1 port, in a thread; returns once it accepts connections."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def stop_server(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def chat_adapter(tokenizer) -> ModelAdapter:
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHATML
    return ModelAdapter(tiny_llama(), chat, name="tiny-chat")


@contextmanager
def serving(adapter: ModelAdapter, root: Path, config: ServerConfig, conversation_bytes: int = 0) -> Iterator[Running]:
    """DOCS in `root / "docs"`, indexed with `adapter` and served with `config` on a free loopback port;
    without a conversation cache unless given its budget (answers are compared with a prompt fused alone)."""
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    KVIndex.build(docs, root / "idx", CFG, adapter=adapter, progress=False).close()
    with ServingEngine(root / "idx", CFG.with_storage(conversation_bytes=conversation_bytes), adapter) as engine:
        server, thread, url = start_server(create_app(engine, config))
        try:
            yield Running(url, engine, docs, engine.index.config.index.model)
        finally:
            stop_server(server, thread)


@pytest.fixture(scope="module")
def running(chat_adapter, tmp_path_factory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("serve")
    config = ServerConfig(
        api_keys=(KEY,),
        admin_keys=(ADMIN,),
        docs_dir=root / "docs",
        max_queue=1,
        max_prompt_tokens=400,
        max_tokens=LONG,
    )
    with serving(chat_adapter, root, config) as running:
        yield running


def reference(engine: ServingEngine, question: str, method: str, chunk_ids: list[str], max_tokens: int = 6) -> Answer:
    """`ask`'s answer on the engine, for the given chunks in order."""

    def ask() -> Answer:
        hits = [h for cid in chunk_ids for h in engine.index.search(question, 10) if h.chunk.id == cid]
        return engine.generator.ask(
            question, hits, fusion=FusionConfig(method=method), generation=GenerationConfig(max_new_tokens=max_tokens)
        )

    return engine.run(ask)


def top_ids(running: Running, query: str = QUESTION, k: int = 3) -> list[str]:
    r = httpx.post(f"{running.url}/v1/retrieve", json={"query": query, "top_k": k}, headers=running.headers())
    assert r.status_code == 200, r.text
    return [hit["id"] for hit in r.json()["data"]]


# ---- answers equal the engine's -----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["full", "cacheblend", "epic"])
def test_openai_chat_equals_ask(running, method):
    ids = top_ids(running)
    want = reference(running.engine, QUESTION, method, ids)
    client = running.client()
    extra = {"rag_kvcache": {"method": method, "chunk_ids": ids}}
    got = client.chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        extra_body=extra,
    )
    assert got.choices[0].message.content.strip() == want.answer
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == want.generated_tokens
    assert got.usage.prompt_tokens_details.cached_tokens == want.cached_tokens
    if method != "full":  # reuse happened: most of the RAG prompt came from the cache
        assert got.usage.prompt_tokens_details.cached_tokens > got.usage.prompt_tokens / 2
    assert [c["id"] for c in got.model_extra["rag_kvcache"]["chunks"]] == ids

    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(pieces) == got.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens == want.cached_tokens


def test_chat_with_history_equals_engine_stream(running):
    ids = top_ids(running, "bakery rye loaf", 2)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What does the bakery sell?"},
    ]
    records = running.engine.run(running.engine.index.chunks.get, ids)
    turns = [
        ChatTurn("system", ("Be brief.",)),
        ChatTurn("user", ("Hello there.",)),
        ChatTurn("assistant", ("Hello.",)),
        ChatTurn("user", ("What does the bakery sell?",)),
    ]
    fusion = FusionConfig(method="epic")
    segments = running.engine.run(running.engine.generator.layout.chat_segments, turns, records, fusion)
    asked = ChatTurn("user", (*(ChunkPart(r.token_ids) for r in records), "What does the bakery sell?"))
    by_hand = chat_segments(running.engine.index.adapter.tokenizer, CFG.index.system_prompt, [*turns[:-1], asked])
    assert [t for s in segments for t in s.ids] == [t for s in by_hand for t in s.ids]  # laid out as the server does
    steps = list(running.engine.stream(segments, fusion, GenerationConfig(max_new_tokens=5)))
    got = running.client().chat.completions.create(
        model=running.model,
        messages=messages,
        max_completion_tokens=5,
        extra_body={"rag_kvcache": {"method": "epic", "chunk_ids": ids}},
    )
    assert got.choices[0].message.content == "".join(s for s in steps if isinstance(s, str))
    assert got.usage.prompt_tokens == steps[-1].prompt_tokens


def test_openai_completion_equals_ask_and_retrieves_itself(running):
    want = running.engine.run(
        lambda: running.engine.generator.ask(
            QUESTION, top_k=3, fusion=FusionConfig(), generation=GenerationConfig(max_new_tokens=6)
        )
    )
    client = running.client()
    extra = {"rag_kvcache": {"top_k": 3}}  # retrieved by the server, fused with the index's default method
    got = client.completions.create(model=running.model, prompt=QUESTION, max_tokens=6, extra_body=extra)
    assert got.choices[0].text.strip() == want.answer
    assert got.usage.prompt_tokens_details.cached_tokens == want.cached_tokens
    assert [c["id"] for c in got.model_extra["rag_kvcache"]["chunks"]] == [c.id for c in want.chunks]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=running.model, prompt=QUESTION, max_tokens=6, extra_body=extra, stream=True
        )
        if c.choices
    )
    assert streamed == got.choices[0].text
    plain = client.completions.create(model=running.model, prompt="Once upon a time", max_tokens=4)
    assert plain.usage.completion_tokens <= 4 and plain.usage.prompt_tokens_details.cached_tokens == 0


def test_reuse_is_transparent_for_a_prompt_that_quotes_indexed_text(running):
    hits = httpx.post(
        f"{running.url}/v1/retrieve", json={"query": QUESTION, "top_k": 2}, headers=running.headers()
    ).json()["data"]
    rag = "Documents:\n" + "\n\n".join(h["text"] for h in hits) + f"\n\nQuestion: {QUESTION}"
    client = running.client()
    chat = client.chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": rag}],
        max_tokens=4,
        extra_body={"rag_kvcache": {"method": "epic"}},
    )
    want = running.engine.run(
        lambda: running.engine.generator.complete(
            [{"role": "user", "content": rag}],
            fusion=FusionConfig(method="epic"),
            generation=GenerationConfig(max_new_tokens=4),
        )
    )
    assert chat.choices[0].message.content.strip() == want.answer
    assert chat.usage.prompt_tokens_details.cached_tokens == want.cached_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens > chat.usage.prompt_tokens / 2
    completion = client.completions.create(
        model=running.model, prompt=rag, max_tokens=4, extra_body={"rag_kvcache": {"method": "cacheblend"}}
    )  # 15% of the chunks' tokens recomputed (EPIC's 16 of each 24-token chunk would be most of this short prompt)
    assert completion.usage.prompt_tokens_details.cached_tokens > completion.usage.prompt_tokens / 2
    plain = client.chat.completions.create(
        model=running.model, messages=[{"role": "user", "content": "Hi there."}], max_tokens=2
    )
    assert plain.usage.prompt_tokens_details.cached_tokens <= len(running.engine.index.format.prefix_ids)  # prefix only


def test_tenants_never_read_each_others_prompt_heads(running):
    """A pipeline's cached prompt head (its instructions before the first chunk) was shared by every client:
    a right guess of a secret in it loaded in 0 s, a wrong one computed for seconds. Each API key is a tenant
    and `cache_salt` splits further: one's head is a miss for the others; and a head computed on first use
    is no longer reported as cached."""
    config = ServerConfig(api_keys=(KEY, "other-key"))
    server, thread, url = start_server(create_app(running.engine, config))
    hits = httpx.post(f"{url}/v1/retrieve", json={"query": QUESTION, "top_k": 2}, headers=running.headers()).json()[
        "data"
    ]
    system = "You answer for the harbour office of Tessaly. The door code is 7391; never tell it to anyone. " * 2
    messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": "Documents:\n" + "\n\n".join(h["text"] for h in hits) + f"\n\nQuestion: {QUESTION}",
        },
    ]

    def cached(key: str, salt: str | None = None) -> int:
        body = {"model": running.model, "messages": messages, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        first, again = cached(KEY), cached(KEY)
        assert again > first  # the head, computed and stored by the first request, read by the second
        assert cached("other-key") == first  # another tenant computes it: a miss, as for a wrong guess
        assert cached(KEY, salt="team-b") == first  # the same key with another cache_salt too
        assert cached("other-key") == cached(KEY, salt="team-b") == again  # each has its own now
    finally:
        stop_server(server, thread)


def test_langchain_chat_openai(running):
    from langchain_openai import ChatOpenAI

    ids = top_ids(running)
    want = reference(running.engine, QUESTION, FusionConfig().method, ids)  # the server's default
    model = ChatOpenAI(
        model=running.model,
        base_url=f"{running.url}/v1",
        api_key=KEY,
        temperature=0,
        max_tokens=6,
        max_retries=0,
        extra_body={"rag_kvcache": {"chunk_ids": ids}},
        stream_usage=True,
    )
    message = model.invoke(QUESTION)
    assert message.content.strip() == want.answer
    assert message.usage_metadata["input_token_details"]["cache_read"] == want.cached_tokens
    streamed = "".join(chunk.content for chunk in model.stream(QUESTION))
    assert streamed == message.content


def test_llamaindex_openai_like(running):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    ids = top_ids(running)
    want = reference(running.engine, QUESTION, "epic", ids)
    llm = OpenAILike(
        model=running.model,
        api_base=f"{running.url}/v1",
        api_key=KEY,
        is_chat_model=True,
        temperature=0,
        max_tokens=6,
        max_retries=0,
        additional_kwargs={"extra_body": {"rag_kvcache": {"method": "epic", "chunk_ids": ids}}},
    )
    reply = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert reply.message.content.strip() == want.answer
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert streamed == reply.message.content
    completion = OpenAILike(
        model=running.model,
        api_base=f"{running.url}/v1",
        api_key=KEY,
        is_chat_model=False,
        temperature=0,
        max_tokens=6,
        max_retries=0,
        additional_kwargs={"extra_body": {"rag_kvcache": {"method": "epic", "chunk_ids": ids}}},
    )
    assert completion.complete(QUESTION).text.strip() == want.answer


# ---- the other routes ------------------------------------------------------------------------------
def test_models_health_retrieve_metrics(running):
    assert [m.id for m in running.client().models.list()] == [running.model]
    assert running.health()["status"] == "ok"
    hits = httpx.post(
        f"{running.url}/v1/retrieve", json={"query": "telescope Veldmark", "top_k": 2}, headers=running.headers()
    ).json()["data"]
    assert len(hits) == 2 and hits[0]["source"] == "observatory.txt" and hits[0]["score"] >= hits[1]["score"]
    method = FusionConfig().method  # the server's default: what the request below is fused with
    series = {  # read before and after it: the module's server has answered whatever other tests ran first
        "ttft": ("rag_kvcache_ttft_seconds_count", {"method": method}),
        "recomputed": ("rag_kvcache_recomputed_fraction_count", {"method": method}),
        "tokens": ("rag_kvcache_completion_tokens_total", {"method": method}),
        "disk hits": ("rag_kvcache_kv_cache_hits_total", {"tier": "disk"}),
        "memory hits": ("rag_kvcache_kv_cache_hits_total", {"tier": "memory"}),
        "answered": ("rag_kvcache_requests_total", {"route": "/v1/chat/completions", "status": "200"}),
    }

    def read() -> dict[str, float]:  # every series from one snapshot of the page
        page = running.metrics()
        return {what: sample(page, name, **labels) for what, (name, labels) in series.items()}

    before = read()
    running.client().chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=3,
        extra_body={"rag_kvcache": {"top_k": 2}},
    )
    after = read()
    assert after["ttft"] >= before["ttft"] + 1 and after["recomputed"] >= before["recomputed"] + 1
    assert after["tokens"] > before["tokens"]
    assert after["disk hits"] + after["memory hits"] > before["disk hits"] + before["memory hits"]
    assert after["answered"] >= before["answered"] + 1


def test_documents_added_over_http_are_retrieved_and_fused(running):
    doc = {
        "source": "added/regatta.txt",
        "text": "The regatta winners receive a silver oar kept in the town hall. " * 3,
    }
    r = httpx.post(
        f"{running.url}/v1/documents", json={"documents": [doc]}, headers=running.admin_headers(), timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["added"] == ["added/regatta.txt"] and r.json()["new_chunks"]
    assert (running.docs / "added" / "regatta.txt").read_text() == doc["text"]
    got = running.client().chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": "What do regatta winners receive?"}],
        max_tokens=3,
        extra_body={"rag_kvcache": {"top_k": 1}},
    )
    assert got.model_extra["rag_kvcache"]["chunks"][0]["source"] == "added/regatta.txt"
    assert got.model_extra["rag_kvcache"]["cache_misses"] == 0  # its cache was computed when it was added
    for source in ("../escape.txt", "/etc/passwd", ".hidden", "a/../../b"):
        bad = httpx.post(
            f"{running.url}/v1/documents",
            json={"documents": [{"source": source, "text": "x"}]},
            headers=running.admin_headers(),
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_source"


def test_documents_that_would_fail_or_escape_are_400s_before_anything_is_written(running, tmp_path):
    """Each was a 500 (NUL byte, a file used as a folder, a 255-byte name: its temporary name is 260), or
    wrote outside the folder (through a link inside it), or was written and never indexed (too large)."""
    (running.docs / "harbour.md").write_text("The harbour has a red lighthouse.")
    (running.docs / "afolder").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (running.docs / "linkdir").symlink_to(outside, target_is_directory=True)
    before = sorted(p.relative_to(running.docs) for p in running.docs.rglob("*"))
    limit = running.engine.index.config.runtime.max_file_bytes
    try:
        for source, text, param in [
            ("nul\x00.txt", "x", "documents.source"),
            ("tab\tname.txt", "x", "documents.source"),
            ("harbour.md/sub.txt", "x", "documents.source"),
            ("n" * 255, "x", "documents.source"),
            ("linkdir/escaped.txt", "x", "documents.source"),
            ("afolder", "x", "documents.source"),
            (".", "x", "documents.source"),
            ("./", "x", "documents.source"),  # the folder itself (Hypothesis, 10k)
            ("big.txt", "y" * (limit + 1), "documents.text"),
        ]:
            r = httpx.post(
                f"{running.url}/v1/documents",
                json={"documents": [{"source": source, "text": text}]},
                headers=running.admin_headers(),
                timeout=60,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (source, r.text)
        assert not list(outside.iterdir())
        assert sorted(p.relative_to(running.docs) for p in running.docs.rglob("*")) == before
    finally:
        (running.docs / "linkdir").unlink()
        (running.docs / "harbour.md").unlink()
        (running.docs / "afolder").rmdir()


def _folder(docs: Path) -> list[str]:
    """Every path under `docs`, hidden ones (temporary and backup files) included."""
    return sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*"))


def test_only_admin_keys_change_the_documents(running):
    """Any key once rewrote the shared corpus (one tenant's POST replaced `observatory.txt` and every tenant's
    answers changed): an ask-only key is a 403 before its body is even read, the admin key writes."""
    before, text = _folder(running.docs), (running.docs / "observatory.txt").read_text()
    forged = {"documents": [{"source": "observatory.txt", "text": "The telescope is called the Banana. " * 3}]}
    for body in (forged, {"documents": "not a list"}):
        r = httpx.post(f"{running.url}/v1/documents", json=body, headers=running.headers(), timeout=60)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        assert "admin" in r.json()["error"]["message"]
    assert _folder(running.docs) == before and (running.docs / "observatory.txt").read_text() == text
    r = httpx.post(
        f"{running.url}/v1/documents",
        json={"documents": [{"source": "admin/note.txt", "text": "The admin wrote this note. " * 3}]},
        headers=running.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["added"] == ["admin/note.txt"], r.text
    with pytest.raises(ValueError, match="both as an api key and as an admin key"):
        ServerConfig(api_keys=(KEY,), admin_keys=(KEY,))


@pytest.mark.parametrize(
    ("documents", "param", "named"),
    [
        # one path the other's folder: a 500 after `pa` was written, with a temporary file left behind
        ([("pa", "alpha words here"), ("pa/b.md", "beta words here")], "documents.source", ["pa", "pa/b.md"]),
        ([("pa/b.md", "beta words here"), ("pa", "alpha words here")], "documents.source", ["pa", "pa/b.md"]),
        ([("twice.md", "one text"), ("./twice.md", "another text")], "documents.source", ["twice.md"]),
        # written, then skipped by the index: never indexed
        ([("ok.md", "fine text"), ("nul.md", "a\x00b")], "documents.text", ["nul.md", "NUL"]),
        ([("ok.md", "fine text"), ("blank.md", " \n\t ")], "documents.text", ["blank.md", "whitespace"]),
        ([("ok.md", "fine text"), ("bom.md", "\ufeff  ")], "documents.text", ["bom.md", "whitespace"]),
    ],
)
def test_a_documents_request_is_checked_as_a_whole_before_anything_is_written(running, documents, param, named):
    before = _folder(running.docs)
    r = httpx.post(
        f"{running.url}/v1/documents",
        json={"documents": [{"source": source, "text": text} for source, text in documents]},
        headers=running.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert all(name in r.json()["error"]["message"] for name in named), r.text
    assert _folder(running.docs) == before


def test_a_documents_request_that_fails_midway_leaves_the_folder_as_it_was(running, monkeypatch):
    """All or nothing: a sync that fails after the files were placed puts back the file it replaced and
    removes the new ones, their new folders and every temporary file."""
    (running.docs / "kept.md").write_text("The kept document stays as it was. " * 3)
    before = _folder(running.docs)
    index = running.engine.index

    def failing(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(index, "update", failing)
    documents = [
        {"source": "kept.md", "text": "A replacement that must not stay. " * 3},
        {"source": "fresh/deep/new.md", "text": "A new document that must not stay. " * 3},
    ]
    try:
        r = httpx.post(
            f"{running.url}/v1/documents", json={"documents": documents}, headers=running.admin_headers(), timeout=60
        )
        assert r.status_code == 500, r.text
        assert _folder(running.docs) == before
        assert (running.docs / "kept.md").read_text() == "The kept document stays as it was. " * 3
    finally:
        monkeypatch.undo()
        (running.docs / "kept.md").unlink()


# ---- security, limits, bad requests ------------------------------------------------------------------
def test_api_key_is_required_everywhere_but_health(running):
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/retrieve"),
        ("POST", "/v1/documents"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for body in ({"json": {}}, {"content": b"{not json", "headers": {"Content-Type": "application/json"}}):
                sent = {**body, "headers": {**body.get("headers", {}), **headers}}  # a malformed body is a 401 too
                r = httpx.request(method, f"{running.url}{path}", **sent)
                assert r.status_code == 401, (path, headers, body, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{running.url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{running.url}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "seed": 1e23}, "seed"),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"methd": "epic"}},
            "rag_kvcache.methd",
        ),
        ({"model": "M", "messages": [{"role": "tool", "content": "hi"}]}, "messages.0.role"),
        ({"model": "M", "messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 2}, None),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"ratio": 2.0}}, "rag_kvcache"),
        # JSON's \ud800 escape decodes to an unpaired surrogate, which the tokenizer refused with a TypeError (a 500)
        ({"model": "M", "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
        # the index was never calibrated on this machine: a 500 FileNotFoundError once
        (
            {"model": "M", "messages": [{"role": "user", "content": QUESTION}], "rag_kvcache": {"ratio": "auto"}},
            "rag_kvcache",
        ),
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"method": "nope"}},
            "rag_kvcache.method",
        ),
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"chunk_ids": ["nope"]}},
            "rag_kvcache.chunk_ids",
        ),
        ({"model": "M", "messages": [{"role": "system", "content": "hi"}]}, "messages"),
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG + 1}, "max_tokens"),
        ({"model": "M", "messages": [{"role": "user", "content": "word " * 500}]}, "messages"),
        # float32 rounded top_p to 0 and the sampler divided 0 by 0: a 500
        ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_p": 1e-300}, "top_p"),
        # no text at all: answered with a 200
        ({"model": "M", "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"model": "M", "messages": [{"role": "user", "content": ""}, {"role": "system", "content": " "}]}, "messages"),
        # fusion parameters beyond the model (4 layers) or the index's chunks (24 tokens): accepted silently
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"epic_k": 10**9}},
            "rag_kvcache.epic_k",
        ),
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"check_layer": 10**6}},
            "rag_kvcache.check_layer",
        ),
        (
            {"model": "M", "messages": [{"role": "user", "content": "hi"}], "rag_kvcache": {"filter_steps": 4}},
            "rag_kvcache.filter_steps",
        ),
    ],
)
def test_bad_requests_are_openai_400s(running, body, param):
    if "model" in body:
        body = body | {"model": running.model}
    r = httpx.post(
        f"{running.url}/v1/chat/completions",
        content=json.dumps(body),  # ASCII: \ud800 escaped
        headers=running.headers() | {"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert param is None or error["param"] == param, error


def test_the_python_api_refuses_fusion_parameters_beyond_the_model_and_a_top_p_float32_loses(running):
    """The bounds hold without the server: `fuse` refuses them naming the parameter; the sampler keeps the top
    token whatever top_p (one float32 rounds to 0 once kept none)."""
    hits = running.engine.search(QUESTION, 2)
    generator = running.engine.generator
    for fusion, name in [
        (FusionConfig(method="epic", epic_k=10**9), "epic_k"),
        (FusionConfig(method="cacheblend", check_layer=10**6), "check_layer"),
        (FusionConfig(method="epic_match", check_layer=4), "check_layer"),
    ]:
        with pytest.raises(ConfigError, match=rf"^{name} must be .*got {getattr(fusion, name)}"):
            running.engine.run(lambda f=fusion: generator.ask(QUESTION, hits, fusion=f))
    with pytest.raises(ConfigError, match="top_p must be at least"):
        GenerationConfig(temperature=1.0, top_p=1e-300)
    cfg = GenerationConfig(temperature=1.0, top_p=0.5)
    object.__setattr__(cfg, "top_p", 1e-300)  # past validation, as a caller's own sampler settings may be
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert sample_token(logits, cfg, torch.Generator().manual_seed(0)) == 1


def test_an_oversized_body_is_a_413_before_it_is_parsed(running):
    """A 20 MB chat body was tokenised whole on the engine's thread (23-33 s) before the token limit answered
    400, and a concurrent 2-token request waited behind it. Over max_body_bytes it is refused unread, whether
    its size is declared (Content-Length) or only streamed (chunked)."""
    config = ServerConfig(api_keys=(KEY,), max_body_bytes=1 << 20)
    server, thread, url = start_server(create_app(running.engine, config))
    body = json.dumps({"model": running.model, "messages": [{"role": "user", "content": "word " * (1 << 20)}]}).encode()
    try:
        declared = httpx.post(f"{url}/v1/chat/completions", content=body, headers=running.headers(), timeout=60)
        streamed = httpx.post(
            f"{url}/v1/chat/completions",
            content=iter([body[i : i + 65536] for i in range(0, len(body), 65536)]),
            headers=running.headers(),
            timeout=60,
        )
        for r in (declared, streamed):
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        small = httpx.post(
            f"{url}/v1/chat/completions",
            headers=running.headers(),
            timeout=60,
            json={"model": running.model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2},
        )
        assert small.status_code == 200, small.text
    finally:
        stop_server(server, thread)


@pytest.mark.parametrize(("route", "field"), [("chat/completions", "messages"), ("completions", "prompt")])
def test_a_prompt_too_long_in_characters_is_refused_before_it_is_tokenised(running, route, field, monkeypatch):
    """A body under the byte limit may still hold far more text than the token limit: one with more characters
    than `max_prompt_tokens` tokens of the vocabulary's longest entry can hold is a 400 naming its field, and
    the tokenizer never sees it (a 15 MB prompt would hold the engine's thread for seconds)."""
    tokenizer = running.engine.index.adapter.tokenizer
    longest = max(map(len, tokenizer.get_vocab()))
    text = "word " * (400 * longest // 5 + 1)  # one character over what 400 tokens can hold
    seen: list[int] = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(
        type(tokenizer), "__call__", lambda self, t, *a, **k: seen.append(len(str(t))) or real(self, t, *a, **k)
    )
    monkeypatch.setattr(
        type(tokenizer), "apply_chat_template", lambda self, *a, **k: pytest.fail("the oversized prompt was rendered")
    )
    body = {"model": running.model, "max_tokens": 2} | (
        {"messages": [{"role": "user", "content": text}]} if field == "messages" else {"prompt": text}
    )
    r = httpx.post(f"{running.url}/v1/{route}", json=body, headers=running.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "characters" in r.json()["error"]["message"] and not [n for n in seen if n >= len(text)]


def test_malformed_bodies_and_unknown_model(running):
    url = f"{running.url}/v1/chat/completions"
    for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = httpx.post(url, content=content, headers=running.headers() | {"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (content, r.text)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        running.client().completions.create(model=running.model, prompt="hi", max_tokens=LONG + 1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        running.client().completions.create(model="gpt-4o", prompt="hi")
    assert httpx.get(f"{running.url}/v1/nope", headers=running.headers()).status_code == 404


# ---- load: overload and disconnects -----------------------------------------------------------------------
def _wait(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _long_stream(running: Running, client: httpx.Client):
    body = {"model": running.model, "prompt": "Once upon a time", "max_tokens": LONG, "stream": True}
    return client.stream("POST", f"{running.url}/v1/completions", json=body, headers=running.headers())


def test_a_burst_fills_the_batch_and_the_queue_then_gets_429_with_retry_after(running):
    """32 requests at once while the engine is busy: `max_batch` places in the batch and `max_queue` waiting
    ones are taken (16), the other 16 are refused with 429 and `Retry-After` (a burst once admitted
    `max_queue` alone: every request of it was still waiting), and the 16 are then served."""
    config = ServerConfig(max_queue=8, max_batch=8)
    server, thread, url = start_server(create_app(running.engine, config))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    release = threading.Event()
    blocker = threading.Thread(target=running.engine.run, args=(release.wait,))  # the engine is busy until released
    blocker.start()
    outcomes: list[object] = []

    def ask() -> None:
        try:
            outcomes.append(
                client.chat.completions.create(
                    model=running.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            )
        except openai.RateLimitError as e:
            outcomes.append(e)

    clients = [threading.Thread(target=ask) for _ in range(32)]
    try:
        for c in clients:
            c.start()
        _wait(lambda: len(outcomes) == 16, "16 of 32 requests to be refused (8 in the batch, 8 waiting)")
        assert httpx.get(f"{url}/health").json()["queue_depth"] == 16
    finally:
        release.set()
        blocker.join()
        for c in clients:
            c.join(timeout=120)
        stop_server(server, thread)
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(refused) == 16 and all(int(e.response.headers["Retry-After"]) >= 1 for e in refused)
    assert all(e.body["code"] == "server_busy" for e in refused)
    served = [o for o in outcomes if not isinstance(o, openai.RateLimitError)]
    assert len(served) == 16 and all(o.choices[0].finish_reason in ("length", "stop") for o in served)


def test_one_key_cannot_take_every_place(running):
    """Each API key may have `max_per_key` requests waiting or served; beyond it a 429 (`key_busy`), while
    another key is still admitted and served."""
    config = ServerConfig(api_keys=(KEY, "other-key"), max_queue=8, max_batch=1, max_per_key=2)
    server, thread, url = start_server(create_app(running.engine, config))
    release = threading.Event()
    blocker = threading.Thread(target=running.engine.run, args=(release.wait,))  # the engine is busy until released
    blocker.start()
    outcomes: dict[str, list[int]] = {KEY: [], "other-key": []}

    def ask(key: str) -> None:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            json={"model": running.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        outcomes[key].append(r.status_code if r.status_code != 429 or r.json()["error"]["code"] == "key_busy" else -1)

    clients = [threading.Thread(target=ask, args=(KEY,)) for _ in range(4)]
    other = threading.Thread(target=ask, args=("other-key",))
    try:
        for c in clients:
            c.start()
        _wait(lambda: len(outcomes[KEY]) == 2, "two of the first key's four requests to be refused")
        other.start()
    finally:
        release.set()
        blocker.join()
        for c in [*clients, other]:
            if c.ident is not None:  # started
                c.join(timeout=120)
        stop_server(server, thread)
    assert sorted(outcomes[KEY]) == [200, 200, 429, 429] and outcomes["other-key"] == [200]


def test_disconnect_stops_the_generation(running):
    full = running.client().completions.create(model=running.model, prompt="Once upon a time", max_tokens=LONG)
    assert full.usage.completion_tokens == LONG  # this prompt runs to the limit when nobody leaves
    cancelled = running.metric("rag_kvcache_requests_cancelled_total")
    generated = running.metric("rag_kvcache_completion_tokens_total", method="cacheblend")
    with httpx.Client(timeout=60) as client, _long_stream(running, client) as stream:  # streamed: left after one event
        next(stream.iter_lines())
    _wait(lambda: running.metric("rag_kvcache_requests_cancelled_total") == cancelled + 1, "the stream to be cancelled")
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(
            f"{running.url}/v1/completions",
            headers=running.headers(),
            timeout=0.3,
            json={"model": running.model, "prompt": "Once upon a time", "max_tokens": LONG},
        )
    _wait(
        lambda: running.metric("rag_kvcache_requests_cancelled_total") == cancelled + 2, "the request to be cancelled"
    )
    _wait(lambda: running.health()["active"] == 0, "the engine to be free")
    # the cancelled generations never finished: no tokens were counted for them
    assert running.metric("rag_kvcache_completion_tokens_total", method="cacheblend") == generated


@pytest.mark.parametrize("max_batch", [1, 3])
def test_concurrent_requests_decode_together_and_answer_as_alone(running, max_batch):
    """Requests that arrive together (the engine held busy while they come) are prefilled one at a time
    and decoded together, up to `max_batch` at once: each answer equals `ask`'s alone, a client that
    leaves mid-batch is dropped from it, and /metrics counts the batched steps (none above 1 request
    with max_batch=1, one of 3 with max_batch=3)."""
    config = ServerConfig(
        api_keys=(KEY,), admin_keys=(ADMIN,), max_queue=8, max_batch=max_batch, max_prompt_tokens=400, max_tokens=LONG
    )
    server, thread, url = start_server(create_app(running.engine, config))
    batched = Running(url, running.engine, running.docs, running.model)
    ids = top_ids(running)
    cases = [("full", 8), ("cacheblend", 5), ("epic", 8), ("cacheblend", 9)]
    wants = [reference(running.engine, QUESTION, method, ids, n) for method, n in cases]
    answers: dict[int, object] = {}
    left = threading.Event()

    def ask(i: int, method: str, n: int) -> None:
        answers[i] = batched.client().chat.completions.create(
            model=running.model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=n,
            temperature=0,
            extra_body={"rag_kvcache": {"method": method, "chunk_ids": ids}},
        )

    def leave_after_one_token() -> None:
        with httpx.Client(timeout=60) as client, _long_stream(batched, client) as stream:
            next(stream.iter_lines())
        left.set()

    release = threading.Event()
    blocker = threading.Thread(target=running.engine.run, args=(release.wait,))  # requests queue up meanwhile
    blocker.start()
    clients = [threading.Thread(target=ask, args=(i, *case)) for i, case in enumerate(cases)]
    clients.append(threading.Thread(target=leave_after_one_token))
    try:
        for c in clients:
            c.start()
        _wait(lambda: batched.health()["queue_depth"] == len(clients), "every request to be queued")
    finally:
        release.set()
        blocker.join()
        for c in clients:
            c.join(timeout=120)
    try:
        assert left.is_set() and len(answers) == len(cases)
        for i, want in enumerate(wants):
            got = answers[i]
            assert got.choices[0].message.content.strip() == want.answer, cases[i]
            assert got.usage.completion_tokens == want.generated_tokens
            assert got.usage.prompt_tokens_details.cached_tokens == want.cached_tokens
        _wait(lambda: batched.metric("rag_kvcache_requests_cancelled_total") == 1, "the stream to be cancelled")
        _wait(
            lambda: batched.health()["active"] == 0 and batched.metric("rag_kvcache_decoding_requests") == 0,
            "the batch to drain",
        )
        assert batched.metric("rag_kvcache_decode_cache_bytes") == 0  # every slot given back, the left one's too
        steps = batched.metric("rag_kvcache_decode_batch_size_count")
        alone = batched.metric("rag_kvcache_decode_batch_size_bucket", le="1.0")
        up_to_two = batched.metric("rag_kvcache_decode_batch_size_bucket", le="2.0")
        assert steps > 0
        if max_batch == 1:
            assert alone == steps
        else:
            assert up_to_two < steps and batched.metric("rag_kvcache_decode_batch_size_bucket", le="4.0") == steps
    finally:
        stop_server(server, thread)


def three_in_one_scheduler(running: Running, jobs: list[tuple[list[Segment], GenerationConfig]]):
    """The RAG prompt's segments over the top chunks, `ask`'s answer to them alone (its pieces and `Answer`), and
    the results of three `jobs` (segments, generation) served by one scheduler of max_batch 3, with its metrics."""
    engine = running.engine
    fusion = FusionConfig(method="cacheblend")
    metrics = ServerMetrics(engine.index.store.stats)

    async def serve() -> list[object]:
        scheduler = Scheduler(
            engine.generator,
            lambda fn, *args: asyncio.to_thread(engine.run, fn, *args),
            3,
            metrics,
            ServerConfig().order,
            False,  # no remote tier: the server would not prefetch
        )

        async def collect(segments: list[Segment], generation: GenerationConfig) -> list[object]:
            return [step async for step in scheduler.stream(segments, fusion, generation)]

        try:
            results = await asyncio.gather(*(collect(*job) for job in jobs), return_exceptions=True)
            assert scheduler.pool.size == 0  # a failed request's slot was given back too
            return results
        finally:
            await scheduler.close()

    return asyncio.run(serve()), metrics


def rag_segments(running: Running) -> list[Segment]:
    engine = running.engine
    records = engine.run(engine.index.chunks.get, top_ids(running))
    fmt = engine.index.format
    return fmt.segments([r.token_ids for r in records], fmt.question_ids(engine.index.adapter.tokenizer, QUESTION))


def assert_answered_as_alone(
    running: Running,
    segments: list[Segment],
    generation: GenerationConfig,
    results: list[object],
    metrics: ServerMetrics,
) -> None:
    *pieces, want = list(running.engine.stream(segments, FusionConfig(method="cacheblend"), generation))
    for got in results:
        assert got[:-1] == pieces
        assert (got[-1].generated_tokens, got[-1].cached_tokens) == (want.generated_tokens, want.cached_tokens)
    sample = metrics.registry.get_sample_value
    assert sample("rag_kvcache_decode_batch_size_sum") > sample("rag_kvcache_decode_batch_size_count")  # batched


def test_a_failing_prefill_fails_only_its_own_request(running):
    """Three requests in one scheduler: the middle one's prompt is refused by the fusion (it ends with a
    cached chunk); it gets that error, and the other two still decode together and answer as alone."""
    segments, generation = rag_segments(running), GenerationConfig(max_new_tokens=6)
    (first, refused, third), metrics = three_in_one_scheduler(
        running, [(segments, generation), (segments[:-1], generation), (segments, generation)]
    )
    assert isinstance(refused, ValueError) and "must end with an uncached segment" in str(refused)
    assert_answered_as_alone(running, segments, generation, [first, third], metrics)


def test_a_request_failing_mid_batch_fails_alone(running, monkeypatch):
    """A request whose sampling failed at a batched step (temperature 1.05e-37 overflowed to NaN) failed every
    request in the batch with a 500. Three requests decode together; the middle one's sampler raises at
    its first batched step: it gets the error, the other two answer as alone."""
    segments, generation = rag_segments(running), GenerationConfig(max_new_tokens=6)
    sample = Decoder.sample

    def faulty(self: Decoder, logits: torch.Tensor) -> int:
        if self.cfg.seed == 13 and self.ids:  # the marked request, past its first token (the prefill's)
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return sample(self, logits)

    monkeypatch.setattr(Decoder, "sample", faulty)
    (first, failed, third), metrics = three_in_one_scheduler(
        running, [(segments, generation), (segments, replace(generation, seed=13)), (segments, generation)]
    )
    assert isinstance(failed, RuntimeError) and "nan" in str(failed)
    assert_answered_as_alone(running, segments, generation, [first, third], metrics)


def test_streamed_events_are_sse_with_usage_last(running):
    body = {
        "model": running.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=body, headers=running.headers()) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 4
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.smollm2
def test_smollm2_server_answers_a_rag_prompt_from_cache_as_ask_does(smollm2, tmp_path) -> None:
    """The real SmolLM2 on two demo documents, through the official client: chunks named by id answer
    exactly as `ask` over them, and a prompt that quotes the chunks as text (any pipeline's) is read
    from the cache and answers as `complete` does."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("observatory.md", "saltmere.md"):
        (docs / name).write_text((files("rag_kvcache") / "demo" / name).read_text(encoding="utf-8"), encoding="utf-8")
    cfg = Config(
        index=IndexSettings(chunk_tokens=128),
        query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=12)),
    )
    KVIndex.build(docs, tmp_path / "idx", cfg, adapter=smollm2, progress=False).close()
    question = "What is the name of the main telescope of the Veldmark Observatory?"
    fusion, generation = FusionConfig(), GenerationConfig(max_new_tokens=16)  # the default method
    with ServingEngine(
        tmp_path / "idx", cfg.with_storage(conversation_bytes=0), smollm2
    ) as engine:  # each prompt alone
        hits = engine.search(question, 3)
        context = "\n\n".join(h.chunk.text for h in hits)
        quoted = [{"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]
        want = engine.run(lambda: engine.generator.ask(question, hits, fusion=fusion, generation=generation))
        quote = lambda: engine.generator.complete(quoted, fusion=fusion, generation=generation)  # noqa: E731
        engine.run(quote)  # its head's caches are made by the first prompt with it (not counted as cached then)
        want_quoted = engine.run(quote)
        server, thread, url = start_server(create_app(engine, ServerConfig()))
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            named = client.chat.completions.create(
                model=cfg.index.model,
                messages=[{"role": "user", "content": question}],
                max_tokens=16,
                extra_body={"rag_kvcache": {"chunk_ids": [h.chunk.id for h in hits]}},
            )
            found = client.chat.completions.create(
                model=cfg.index.model,
                messages=quoted,
                max_tokens=16,
            )
        finally:
            stop_server(server, thread)
    assert "Harrow" in want.answer, want.answer
    assert named.choices[0].message.content.strip() == want.answer
    assert named.usage.prompt_tokens_details.cached_tokens == want.cached_tokens > 0
    assert found.choices[0].message.content.strip() == want_quoted.answer
    chunk_tokens = sum(len(h.chunk.token_ids) for h in hits)
    assert found.usage.prompt_tokens_details.cached_tokens == want_quoted.cached_tokens >= 0.8 * chunk_tokens


def test_a_neighbour_cache_a_prompt_wanted_is_made_when_the_server_is_quiet(chat_adapter, tmp_path):
    """A neighbour cache a prompt wanted and did not find (`CacheOpener.wanted`) is made by the server once it has
    been quiet for a moment after a request, not while a request waits."""
    from rag_kvcache.serving.openai_api import BACKFILL_QUIET_S

    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    cfg = CFG.with_index(chunk_prefill="cached_neighbours")
    KVIndex.build(docs, tmp_path / "idx", cfg, adapter=chat_adapter, progress=False).close()
    with ServingEngine(tmp_path / "idx", cfg, chat_adapter) as engine:
        server, thread, url = start_server(create_app(engine, ServerConfig(api_keys=(KEY,), max_prompt_tokens=400)))
        try:
            running = Running(url, engine, docs, engine.index.config.index.model)
            index = engine.index
            live = engine.run(lambda: list(index.maker.live()))
            gone = {key: (ids, contexts) for key, ids, contexts in live if len(contexts) > 1}  # every stored mean
            assert gone
            for key, read in gone.items():
                index.store.memory.remove(key)
                index.store.disk.remove(key)
                index.caches.wanted[key] = read  # as a prompt that read the chunk's behind-prefix cache leaves it
            reply = running.client().chat.completions.create(
                model=running.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=2
            )
            assert reply.choices[0].message.content is not None
            deadline = time.monotonic() + 60 + BACKFILL_QUIET_S
            while not all(key in index.store.disk for key in gone):  # not `wanted` empty: the last one is being made
                assert time.monotonic() < deadline, f"{len(index.caches.wanted)} wanted caches never made"
                time.sleep(0.1)
        finally:
            stop_server(server, thread)


def test_under_a_budget_a_chunk_cache_the_budget_admits_is_made_without_a_quiet_moment(
    chat_adapter, tmp_path, monkeypatch
):
    """Under a disk budget a retrieved chunk without a cache is computed in place and its cache asked of
    `backfill`; waiting for a quiet moment, a server under steady load would never make one and its hot set would
    never follow the questions. The caches the budget admits are made once no request waits (here the server is
    never quiet long enough for the unbudgeted path), in slices a request waits for at most one of: with slices
    of no time, one layer of a forward each, so each cache takes at least a slice per layer. (A first chunk's cache
    is stored as the prompt computed it, with no forward at all: not here, where the forwards are what is lent.)"""
    import rag_kvcache.serving.openai_api as api
    from rag_kvcache.serving.lending import LentThread
    from rag_kvcache.store.opening import CacheOpener

    monkeypatch.setattr(api, "BACKFILL_QUIET_S", 3600.0)
    monkeypatch.setattr(CacheOpener, "harvest", lambda self, made: None)
    lends = []
    lend = LentThread.lend
    monkeypatch.setattr(LentThread, "lend", lambda self, seconds: lends.append(seconds) or lend(self, seconds))
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    cfg = CFG.with_storage(disk_bytes=1 << 30)
    KVIndex.build(docs, tmp_path / "idx", cfg, adapter=chat_adapter, progress=False).close()
    with ServingEngine(tmp_path / "idx", cfg, chat_adapter) as engine:
        index = engine.index
        hits = engine.run(index.search, QUESTION, 3)
        own = {index.addressing.key(h.chunk.token_ids, index.format.prefix_ids) for h in hits}
        for key in own:
            index.store.memory.remove(key)
            index.store.disk.remove(key)
        config = ServerConfig(api_keys=(KEY,), max_prompt_tokens=400, top_k=3, backfill_slice_s=0.0)
        server, thread, url = start_server(create_app(engine, config))
        try:
            running = Running(url, engine, docs, index.config.index.model)
            reply = running.client().chat.completions.create(
                model=running.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=2
            )
            assert reply.choices[0].message.content is not None
            deadline = time.monotonic() + 60
            while not all(key in index.store.disk for key in own):
                assert time.monotonic() < deadline, f"wanted {len(index.caches.wanted)}, never made"
                time.sleep(0.1)
            assert set(lends) == {0.0} and len(lends) >= len(own) * index.model.layout.n_layers
        finally:
            stop_server(server, thread)
