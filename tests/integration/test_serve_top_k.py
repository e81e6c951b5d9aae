"""`serve --top-k N`: a chat that names no chunks of its own (a plain OpenAI client's) is fused with the index's
top N chunks for its last user message, as `rag_kvcache: {"top_k": N}` asks; off by default. A real uvicorn
server on a free loopback port (`test_serve.serving`, its own, so that nothing another test does changes it),
driven by the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from test_serve import QUESTION, Running, chat_adapter, serving, top_ids  # noqa: F401  (chat_adapter: a fixture)
from typer.testing import CliRunner

from rag_kvcache.cli import app
from rag_kvcache.errors import ConfigError
from rag_kvcache.serving.settings import ServerConfig

TOP_K = 2


@pytest.fixture(scope="module")
def retrieving(chat_adapter, tmp_path_factory) -> Iterator[Running]:  # noqa: F811
    with serving(chat_adapter, tmp_path_factory.mktemp("serve-top-k"), ServerConfig(top_k=TOP_K)) as running:
        yield running


def chat(running: Running, extra: dict | None = None):
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="any", max_retries=0)  # a server without keys
    return client.chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        **({"extra_body": extra} if extra else {}),
    )


def chunk_ids(reply) -> list[str]:
    return [c["id"] for c in reply.model_extra["rag_kvcache"]["chunks"]]


def test_a_plain_clients_chat_is_fused_with_the_retrieved_chunks(retrieving):
    plain = chat(retrieving)  # what a plain OpenAI client sends: no rag_kvcache field at all
    asked = chat(retrieving, {"rag_kvcache": {"top_k": TOP_K}})
    assert chunk_ids(plain) == top_ids(retrieving, QUESTION, TOP_K) == chunk_ids(asked)
    cached = plain.usage.prompt_tokens_details.cached_tokens
    assert cached > plain.usage.prompt_tokens / 2  # the retrieved chunks' tokens were read from their caches
    assert (plain.choices[0].message.content, plain.usage.prompt_tokens, cached) == (
        asked.choices[0].message.content,
        asked.usage.prompt_tokens,
        asked.usage.prompt_tokens_details.cached_tokens,
    )


def test_a_request_naming_its_chunks_or_none_keeps_them(retrieving):
    named = top_ids(retrieving, "bakery rye loaf", 1)
    own = chat(retrieving, {"rag_kvcache": {"chunk_ids": named}})
    assert chunk_ids(own) == named
    more = chat(retrieving, {"rag_kvcache": {"top_k": TOP_K + 1}})
    assert len(chunk_ids(more)) == TOP_K + 1
    none = chat(retrieving, {"rag_kvcache": {"top_k": 0}})  # opts out: the prompt as given
    assert chunk_ids(none) == [] and none.usage.prompt_tokens_details.cached_tokens == 0
    assert none.usage.prompt_tokens < own.usage.prompt_tokens
    method_only = chat(retrieving, {"rag_kvcache": {"method": "reuse"}})  # names no chunks: retrieves
    assert chunk_ids(method_only) == top_ids(retrieving, QUESTION, TOP_K)


def test_completions_keep_their_prompt(retrieving):
    client = openai.OpenAI(base_url=f"{retrieving.url}/v1", api_key="any", max_retries=0)
    plain = client.completions.create(model=retrieving.model, prompt="Once upon a time", max_tokens=4)
    assert plain.model_extra["rag_kvcache"]["chunks"] == []
    assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_off_by_default_and_bounded():
    assert ServerConfig().top_k is None
    for bad in (0, 65):
        with pytest.raises(ConfigError, match="top_k"):
            ServerConfig(top_k=bad)


def test_the_cli_option_reaches_the_server_config(monkeypatch, tmp_path):
    seen: dict = {}

    class Stopping(ServerConfig):  # records what `serve` asks for, and stops it there (no model is loaded)
        def __post_init__(self) -> None:
            seen["top_k"] = self.top_k
            raise ValueError("stopped by the test")

    monkeypatch.setattr("rag_kvcache.cli.serving.ServerConfig", Stopping)
    result = CliRunner().invoke(app, ["serve", "--index", str(tmp_path), "--top-k", "3"])
    assert "stopped by the test" in result.output and seen["top_k"] == 3
    CliRunner().invoke(app, ["serve", "--index", str(tmp_path)])
    assert seen["top_k"] is None
    assert CliRunner().invoke(app, ["serve", "--index", str(tmp_path), "--top-k", "0"]).exit_code == 2
