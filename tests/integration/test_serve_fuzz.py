"""Random JSON at every route of a live server (Hypothesis): never a 500, and the server answers afterwards.

Each route gets arbitrary JSON and bodies shaped like its requests with random values in the known fields
(so that validation is passed more often and the engine's own checks are reached). Bounded: generation is
capped by the server's `max_tokens` (8 here), and each route gets `EXAMPLES` bodies.
"""

from __future__ import annotations

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import KEY, chat_adapter, serving  # noqa: F401 (chat_adapter: a fixture)

from rag_kvcache.config import DEFAULT_MODEL
from rag_kvcache.serving.settings import ServerConfig

EXAMPLES = 60
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/retrieve", "/v1/documents")

surrogates = st.text(max_size=8) | st.text(st.characters(codec=None, categories=["Cs"]), min_size=1, max_size=3).map(
    lambda lone: f"a{lone}b"
)  # JSON's \ud800 escapes decode to unpaired surrogates
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | surrogates
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
names = st.text(alphabet=string.ascii_letters + string.digits + "./_-\x00 \t<|>", min_size=0, max_size=300)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | anything,
            "content": st.text(max_size=200) | anything,
        }
    ),
    max_size=4,
)
options = st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(["full", "reuse", "cacheblend", "epic", "epic_match", "prefix", "nope"]) | anything,
        "ratio": st.floats(allow_nan=False) | st.just("auto") | anything,
        "top_k": st.integers(-5, 50) | anything,
        "chunk_ids": st.lists(st.text(max_size=20), max_size=3) | anything,
        "epic_k": st.integers(-5, 100) | anything,
    },
)
sampling = {
    "model": st.just(DEFAULT_MODEL)
    | anything,  # the served model's id: the index's model name "max_tokens": st.integers(-2, 10) | anything,
    "temperature": st.floats(allow_nan=False, allow_infinity=False) | anything,
    "top_p": st.floats(allow_nan=False, allow_infinity=False) | anything,
    "seed": st.integers() | anything,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | anything,
    "stream": st.booleans() | anything,
    "cache_salt": st.text(max_size=300) | anything,
    "rag_kvcache": options | anything,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])})
    | anything,
}
BODIES = {
    "/v1/chat/completions": st.fixed_dictionaries({"messages": messages}, optional=sampling),
    "/v1/completions": st.fixed_dictionaries({"prompt": st.text(max_size=300) | anything}, optional=sampling),
    "/v1/retrieve": st.fixed_dictionaries(
        {"query": st.text(max_size=100) | anything}, optional={"top_k": st.integers(-5, 100) | anything}
    ),
    "/v1/documents": st.fixed_dictionaries(
        {
            "documents": st.lists(
                st.fixed_dictionaries({"source": names | anything, "text": st.text(max_size=300) | anything}),
                max_size=3,
            )
            | anything
        }
    ),
}

words = st.text(alphabet=string.ascii_letters + " ?<|>_\x00\n", min_size=1, max_size=120) | surrogates
valid_options = st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(["full", "reuse", "cacheblend", "epic", "epic_match", "prefix"]),
        "top_k": st.integers(0, 4),
        "ratio": st.floats(0, 1),
    },
)
valid_sampling = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=20),
    "rag_kvcache": valid_options,
}
VALID = {  # bodies the schema accepts: random values where the engine decides
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "model": st.just(DEFAULT_MODEL),
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": words}),
                min_size=1,
                max_size=3,
            ),
        },
        optional=valid_sampling,
    ),
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just(DEFAULT_MODEL), "prompt": words}, optional=valid_sampling
    ),
    "/v1/retrieve": st.fixed_dictionaries({"query": words, "top_k": st.integers(1, 10)}),
    "/v1/documents": st.fixed_dictionaries(
        {
            "documents": st.lists(
                st.fixed_dictionaries(
                    {"source": st.text(alphabet=string.ascii_lowercase + "/._", min_size=1, max_size=40), "text": words}
                ),
                min_size=1,
                max_size=2,
            )
        }
    ),
}


@pytest.fixture(scope="module")
def live(chat_adapter, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("fuzz")
    config = ServerConfig(  # an admin key: the documents route is fuzzed past its permission check
        admin_keys=(KEY,), docs_dir=root / "docs", max_queue=4, max_prompt_tokens=400, max_tokens=8
    )
    with serving(chat_adapter, root, config) as running:
        with httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
            yield client


@pytest.mark.parametrize("route", ROUTES)
def test_random_json_is_never_a_500(live, route):
    seen: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=VALID[route] | BODIES[route] | anything)
    def post(body) -> None:
        r = live.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})  # \ud800 escaped
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text

    post()
    assert live.get("/health").status_code == 200
    assert sum(seen.values()) >= EXAMPLES and any(code < 400 for code in seen), seen  # some got through to the engine
