"""`RagKVCacheConnector` beside vLLM's own prefix caching (CPU build, SmolLM2-135M in float32).

An engine of its own, with prefix caching on (the one in test_vllm_connector.py has it off so that no request
reads another's blocks); runs in `.venv-vllm`, skipped where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

vllm = pytest.importorskip("vllm")

from test_vllm_connector import (  # noqa: E402
    Built,
    assert_close,
    built,  # noqa: F401  (the fixture)
    first_logprobs,
    generate,
    kv_transfer_config,
    loaded,
)
from vllm import LLM  # noqa: E402

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def cached_llm(built: Built) -> Iterator[LLM]:  # noqa: F811
    engine = LLM(
        model=built.model,
        dtype="float32",
        gpu_memory_utilization=0.25,
        max_model_len=4096,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config(built.path, "prefix"),
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_fused_blocks_stay_out_of_vllms_prefix_cache(cached_llm: LLM, built: Built) -> None:  # noqa: F811
    """A prompt fused with `reuse` (inexact past its exact head) leaves none of its inexact blocks in vLLM's prefix
    cache: the same prompt asked next with `prefix` reads only the exact head (vLLM's cached full blocks of it, the
    connector the rest) and answers as vLLM alone, not with the fused approximation."""
    head = len(built.prefix_ids) + len(built.chunks[0])  # the system prefix and the first chunk: exact
    fused = generate(cached_llm, built.prompt, params={"method": "reuse"}, max_tokens=1)
    assert loaded(fused) == len(built.prompt) - len(built.question)
    exact = generate(cached_llm, built.prompt, params={"method": "prefix"})
    alone = generate(cached_llm, built.prompt, alone=True)  # asked last: it writes exact blocks of the whole prompt
    assert exact.num_cached_tokens == head, (exact.num_cached_tokens, head)
    assert exact.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_close(first_logprobs(exact), first_logprobs(alone))
