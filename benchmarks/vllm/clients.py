"""TTFT and requests/s through HTTP at 1 and 16 clients: vLLM's OpenAI server with `RagKVCacheConnector` per
method, and `rag-kvcache serve`, asked the same RAG chat prompts with the official `openai` client.

From the repository root, after `benchmarks/vllm/ttft.py` built WORK_DIR/index (MuSiQue passages, 512-token
chunks), in `.venv` (our server and the clients; vLLM's server runs from `.venv-vllm`):

    flock /tmp/bench.lock nice -n 5 .venv/bin/python benchmarks/vllm/clients.py \
        /work/shared/data/musique_dev.json WORK_DIR benchmarks/vllm/clients.json [N_QUESTIONS]

Each question's messages: the index's system prompt, then "Documents:" with the text of its top-6 retrieved
chunks and the question, as a RAG application sends them; each server tokenises the text and finds the
chunks itself. vLLM's server has prefix caching off, so no request reads another's blocks; its "alone" row
asks with method `full`, which the connector answers without looking at the index (vLLM computes every
token). Our server runs with `--conversation-bytes 0` (a repeated prompt would otherwise be read from its
conversation cache). One client: each prompt streamed once after a warm-up, TTFT = time to the first
content chunk. 16 clients: 16 threads, each sending one prompt (the questions' prompts in turn) at once;
requests/s = 16 / the wall time until the last finished, and the median of the 16 TTFTs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.index import KVIndex

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "chat"))
from conversation import free_port, wait_healthy  # noqa: E402  (a script beside this one)

CLIENTS = 16
MAX_TOKENS = 8
VLLM_ROWS = ("full", "prefix", "reuse", "epic", "cacheblend")  # `full`: vLLM alone
SERVE_ROWS = ("full", "reuse", "epic", "cacheblend")
AT_ONCE = {"vllm": ("full", "reuse", "cacheblend"), "rag-kvcache serve": ("full", "reuse", "cacheblend")}


class Endpoint:
    """An OpenAI-compatible server in a subprocess on a free loopback port, and how to pass it a method."""

    def __init__(self, argv: list[str], port: int, log: Path, method_body) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        self.url = f"http://127.0.0.1:{port}"
        self.method_body = method_body
        wait_healthy(self.proc, self.url, 900, lambda: f"{argv[:3]}, see {log}")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=1800)
        self.model = self.client.models.list().data[0].id

    def ask(self, messages: list[dict], method: str) -> dict:
        t0 = time.perf_counter()
        ttft, last = None, None
        for chunk in self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=self.method_body(method),
        ):
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
            last = chunk
        end = time.perf_counter() - t0
        return {"ttft_s": end if ttft is None else ttft, "end_s": end, "prompt_tokens": last.usage.prompt_tokens}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def measure(endpoint: Endpoint, rows: tuple[str, ...], at_once: tuple[str, ...], prompts: list[list[dict]]) -> dict:
    out: dict = {}
    for method in rows:
        endpoint.ask(prompts[0], method)  # warm-up
        one = [endpoint.ask(p, method) for p in prompts]
        out[method] = {
            "1 client ttft_s": [r["ttft_s"] for r in one],
            "prompt_tokens": [r["prompt_tokens"] for r in one],
        }
        print(
            f"  {method}: 1 client, median TTFT {statistics.median(out[method]['1 client ttft_s']):.3f} s", flush=True
        )
        if method not in at_once:
            continue
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            many = list(pool.map(lambda i: endpoint.ask(prompts[i % len(prompts)], method), range(CLIENTS)))
        wall = time.perf_counter() - t0
        out[method] |= {
            f"{CLIENTS} clients requests_per_s": CLIENTS / wall,
            f"{CLIENTS} clients ttft_s": [r["ttft_s"] for r in many],
        }
        print(
            f"  {method}: {CLIENTS} clients, {CLIENTS / wall:.2f} requests/s, median TTFT "
            f"{statistics.median(out[method][f'{CLIENTS} clients ttft_s']):.2f} s",
            flush=True,
        )
    return out


def main() -> None:
    data, work, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    n_questions = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    examples = load_dataset(data, "musique")[:n_questions]
    index = KVIndex.open(work / "index")
    model_dir = str(index.adapter.model.name_or_path)
    system = index.config.index.system_prompt
    prompts = [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": "Documents:\n"
                + "\n\n".join(h.chunk.text for h in index.search(ex.question, 6))
                + f"\n\nQuestion: {ex.question}",
            },
        ]
        for ex in examples
    ]
    index.close()
    results: dict = {"questions": [ex.id for ex in examples], "max_tokens": MAX_TOKENS}

    port = free_port()
    connector = {
        "kv_connector": "RagKVCacheConnector",
        "kv_connector_module_path": "rag_kvcache.serving.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"index": str(work / "index"), "method": "prefix"},
    }
    t0 = time.perf_counter()
    vllm = Endpoint(
        [
            str(ROOT / ".venv-vllm/bin/python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
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
            "--no-enable-prefix-caching",
            "--served-model-name",
            "smollm2",
            "--kv-transfer-config",
            json.dumps(connector),
        ],
        port,
        work / "vllm-serve.log",
        lambda m: {"kv_transfer_params": {"method": m}},
    )
    print(f"vLLM server up in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        results["vllm"] = measure(vllm, VLLM_ROWS, AT_ONCE["vllm"], prompts)
    finally:
        vllm.close()

    port = free_port()
    ours = Endpoint(
        [
            str(ROOT / ".venv/bin/rag-kvcache"),
            "serve",
            "--index",
            str(work / "index"),
            "--port",
            str(port),
            "--conversation-bytes",
            "0",
            "--max-queue",
            str(CLIENTS),
            "--max-batch",
            "8",
        ],
        port,
        work / "rag-serve.log",
        lambda m: {"rag_kvcache": {"method": m}},
    )
    try:
        results["rag-kvcache serve"] = measure(ours, SERVE_ROWS, AT_ONCE["rag-kvcache serve"], prompts)
    finally:
        ours.close()

    out_path.write_text(json.dumps(results, indent=1), encoding="utf-8")
    alone = statistics.median(results["vllm"]["full"]["1 client ttft_s"])
    print(
        f"| server | method | median TTFT, 1 client (s) | vLLM alone / it | {CLIENTS} clients: requests/s | median TTFT (s) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for server in ("vllm", "rag-kvcache serve"):
        for method, row in results[server].items():
            med = statistics.median(row["1 client ttft_s"])
            many = row.get(f"{CLIENTS} clients ttft_s")
            print(
                f"| {server} | {method} | {med:.3f} | {alone / med:.1f} | "
                f"{row.get(f'{CLIENTS} clients requests_per_s', float('nan')):.2f} | "
                f"{statistics.median(many) if many else float('nan'):.2f} |"
            )


if __name__ == "__main__":
    main()
