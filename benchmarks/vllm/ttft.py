"""TTFT of vLLM alone, vLLM with `RagKVCacheConnector` per method, and the embedded engine, on MuSiQue top-6
prompts, side by side in one run (CPU, SmolLM2-135M, float32). From the repository root:

    flock /tmp/bench.lock nice -n 10 .venv-vllm/bin/python benchmarks/vllm/ttft.py \
        /work/shared/data/musique_dev.json WORK_DIR benchmarks/vllm/results.json [N_QUESTIONS]

The first N_QUESTIONS (default 4) questions' passages are indexed with 512-token chunks (WORK_DIR/index;
reused when there); each question's prompt is the `native` layout of its top-6 retrieved chunks
(`PromptFormat.segments`), handed to vLLM as token ids. One vLLM engine serves every vLLM row; prefix
caching is off so that no row reads another's blocks, and "vLLM alone" is a request with
`skip_reading_prefix_cache` (vLLM's scheduler then takes no token from any cache, the connector's included).
TTFT at 1 client is the wall time of `LLM.generate(max_tokens=1)` for one prompt (scheduling, the
connector's matching and load, the prefill and the first sample), one warm-up request per row first.
Throughput at 16 clients: one `LLM.generate` call over 16 prompts (the questions' prompts repeated).
The embedded engine's TTFT is `FusedGenerator.ask`'s `ttft_s` in this process, with the engine idle.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from rag_kvcache.bench.corpus import write_corpus
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator

ROWS: dict[str, dict | None] = {  # row -> the request's kv_transfer_params (None: vLLM alone)
    "vLLM alone": None,
    "connector prefix": {"method": "prefix"},
    "connector reuse": {"method": "reuse"},
    "connector epic": {"method": "epic"},
    "connector cacheblend": {"method": "cacheblend"},
}
BATCH_ROWS = ("vLLM alone", "connector reuse", "connector cacheblend")
ENGINE_METHODS = ("full", "prefix", "reuse", "epic", "cacheblend")
CLIENTS = 16


def params(kv: dict | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        skip_reading_prefix_cache=kv is None or None,
        extra_args=None if kv is None else {"kv_transfer_params": kv},
    )


def main() -> None:
    data, work, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    n_questions = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    examples = load_dataset(data, "musique")[:n_questions]
    write_corpus(examples, work / "docs")
    index = KVIndex.build(work / "docs", work / "index", Config(index=IndexSettings(chunk_tokens=512)), progress=False)
    fmt, tok = index.format, index.adapter.tokenizer
    hits = [index.search(ex.question, 6) for ex in examples]
    prompts = [
        [t for s in fmt.segments([h.chunk.token_ids for h in hs], fmt.question_ids(tok, ex.question)) for t in s.ids]
        for ex, hs in zip(examples, hits)
    ]
    results: dict = {"prompt_tokens": [len(p) for p in prompts], "questions": [ex.id for ex in examples]}

    generator = FusedGenerator(index)
    engine: dict[str, list[float]] = {}
    for method in ENGINE_METHODS:

        def run(ex, hs, method=method) -> float:
            fusion, generation = FusionConfig(method=method), GenerationConfig(max_new_tokens=1)
            return generator.ask(ex.question, hs, fusion=fusion, generation=generation).ttft_s

        run(examples[0], hits[0])  # warm-up
        engine[method] = [run(ex, hs) for ex, hs in zip(examples, hits)]
    results["embedded engine ttft_s"] = engine

    t0 = time.perf_counter()
    llm = LLM(
        model=str(index.adapter.model.name_or_path),
        dtype="float32",
        gpu_memory_utilization=0.25,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "RagKVCacheConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "rag_kvcache.serving.vllm_connector",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"index": str(work / "index"), "method": "prefix"},
        },
    )
    results["engine_start_s"] = time.perf_counter() - t0
    index.close()

    ttft: dict[str, list[float]] = {}
    loaded: dict[str, list[int]] = {}
    for row, kv in ROWS.items():
        llm.generate(TokensPrompt(prompt_token_ids=prompts[0]), params(kv), use_tqdm=False)  # warm-up
        ttft[row], loaded[row] = [], []
        for ids in prompts:
            t0 = time.perf_counter()
            got = llm.generate(TokensPrompt(prompt_token_ids=ids), params(kv), use_tqdm=False)[0]
            ttft[row].append(time.perf_counter() - t0)
            loaded[row].append(((got.kv_transfer_params or {}).get("rag_kvcache") or {}).get("loaded_tokens", 0))
    results["vllm ttft_s (1 client)"] = ttft
    results["loaded_tokens"] = loaded

    batch = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(CLIENTS)]
    throughput = {}
    for row in BATCH_ROWS:
        t0 = time.perf_counter()
        llm.generate(batch, params(ROWS[row]), use_tqdm=False)
        throughput[row] = CLIENTS / (time.perf_counter() - t0)
    results[f"vllm requests_per_s ({CLIENTS} at once, max_tokens=1)"] = throughput
    llm.llm_engine.engine_core.shutdown()

    out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    alone = statistics.median(ttft["vLLM alone"])
    print(f"prompt tokens {results['prompt_tokens']}; engine start {results['engine_start_s']:.0f} s")
    print("| row | median TTFT s | x vs vLLM alone | loaded tokens (median) |")
    print("|---|---|---|---|")
    for row, times in ttft.items():
        med = statistics.median(times)
        print(f"| {row} | {med:.3f} | {alone / med:.1f} | {statistics.median(loaded[row]):.0f} |")
    for method, times in engine.items():
        print(
            f"| embedded engine {method} | {statistics.median(times):.3f} | {alone / statistics.median(times):.1f} | |"
        )
    for row, rps in throughput.items():
        print(f"{row}: {rps:.2f} requests/s with {CLIENTS} at once")


if __name__ == "__main__":
    main()
