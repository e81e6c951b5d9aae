"""Bounded load test of `rag-kvcache serve` on loopback with MuSiQue prompts.

Indexes the passages of the first `--questions` MuSiQue questions (under `--work`, reused by later
runs), starts `rag-kvcache serve --max-batch B` on a free 127.0.0.1 port for each `--max-batch`
value, retrieves each question's top-k chunks once (`/v1/retrieve`), and for every client count and
method, on each server in turn (so that batched and one-at-a-time levels see the same machine), sends `--requests-per-client` streamed chat requests per client (the question,
with the chunks named in `rag_kvcache.chunk_ids`), measuring client side: TTFT (request sent ->
first content token, queueing included), requests/s and output tokens/s over the level's wall time,
errors, the server's peak RSS and the load average at the level's end; server side, the mean
decode batch size (from /metrics). Writes
`results.json` and `results.md` to `--out`. See README.md for the command and the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

from rag_kvcache.bench.corpus import write_corpus
from rag_kvcache.bench.datasets import load_dataset


@dataclass(frozen=True)
class Level:
    max_batch: int
    method: str
    clients: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    requests_per_s: float
    output_tokens_per_s: float
    cached_fraction: float
    peak_rss_mib: float
    mean_decode_batch: float  # requests per batched decoding step over the level (server side)
    load_average: float  # the machine's 1-minute load average when the level ended
    server_cpu_s_per_request: float  # the server process's CPU time (user + system) over the level, per request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(
    client: openai.AsyncOpenAI, model: str, question: str, chunk_ids: list[str], method: str, max_tokens: int
) -> tuple[float, float, int, int, int]:
    """(ttft, e2e, completion tokens, prompt tokens, cached tokens) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft = None
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"rag_kvcache": {"method": method, "chunk_ids": chunk_ids}},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - t0
    return (
        (ttft if ttft is not None else e2e),
        e2e,
        usage.completion_tokens,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def decode_batches(url: str) -> tuple[float, float]:
    """(steps, requests advanced) so far: the server's decode batch-size histogram's count and sum."""
    text = httpx.get(f"{url}/metrics").text
    found = dict(re.findall(r"^rag_kvcache_decode_batch_size_(count|sum) (\S+)$", text, re.MULTILINE))
    return float(found.get("count", 0)), float(found.get("sum", 0))


async def run_level(
    url: str,
    model: str,
    prompts: list[tuple[str, list[str]]],
    method: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    server_pid: int,
    max_batch: int,
) -> Level:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    todo = [prompts[i % len(prompts)] for i in range(clients * per_client)]
    results, errors = [], 0
    peak = rss_mib(server_pid)
    steps0, rows0 = decode_batches(url)
    cpu0 = cpu_seconds(server_pid)

    async def worker() -> None:
        nonlocal errors
        while todo:
            question, ids = todo.pop(0)
            try:
                results.append(await one_request(client, model, question, ids, method, max_tokens))
            except openai.OpenAIError as e:
                errors += 1
                print(f"  error: {type(e).__name__}: {e}", file=sys.stderr)

    async def sample_memory() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mib(server_pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample_memory())
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    sampler.cancel()
    await client.close()
    steps1, rows1 = decode_batches(url)
    cpu1 = cpu_seconds(server_pid)
    ttfts = [r[0] for r in results]
    return Level(
        max_batch=max_batch,
        method=method,
        clients=clients,
        requests=len(results),
        errors=errors,
        wall_s=wall,
        ttft_p50_s=statistics.median(ttfts),
        ttft_p99_s=percentile(ttfts, 0.99),
        e2e_p50_s=statistics.median(r[1] for r in results),
        requests_per_s=len(results) / wall,
        output_tokens_per_s=sum(r[2] for r in results) / wall,
        cached_fraction=sum(r[4] for r in results) / max(1, sum(r[3] for r in results)),
        peak_rss_mib=peak,
        mean_decode_batch=(rows1 - rows0) / max(1.0, steps1 - steps0),
        load_average=os.getloadavg()[0],
        server_cpu_s_per_request=(cpu1 - cpu0) / max(1, len(results)),
    )


def markdown(levels: list[Level], command: str) -> str:
    header = (
        "| max batch | method | clients | requests | errors | TTFT p50 (s) | TTFT p99 (s) | e2e p50 (s) | req/s | "
        "out tok/s | cached | decode batch | server CPU s/request | server peak RSS (MiB) | load avg |"
    )
    lines = [f"`{command}`", "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in levels:
        lines.append(
            f"| {v.max_batch} | {v.method} | {v.clients} | {v.requests} | {v.errors} | {v.ttft_p50_s:.2f} | "
            f"{v.ttft_p99_s:.2f} | {v.e2e_p50_s:.2f} | {v.requests_per_s:.3f} | {v.output_tokens_per_s:.1f} | "
            f"{v.cached_fraction:.0%} | {v.mean_decode_batch:.1f} | {v.server_cpu_s_per_request:.1f} | "
            f"{v.peak_rss_mib:.0f} | {v.load_average:.1f} |"
        )
    by = {(v.max_batch, v.method, v.clients): v for v in levels}
    batches = sorted({v.max_batch for v in levels})
    top = max(v.clients for v in levels)
    for b in batches:
        if (b, "full", top) in by and (b, "cacheblend", top) in by:
            full, blend = by[b, "full", top], by[b, "cacheblend", top]
            lines += [
                "",
                (
                    f"max batch {b}, {top} clients: cacheblend serves "
                    f"{blend.requests_per_s / full.requests_per_s:.2f}x the requests/s of full (target >= 2.8x); "
                    f"cacheblend p99 TTFT {blend.ttft_p99_s:.2f} s vs full p50 {full.ttft_p50_s:.2f} s "
                    "(target: below)."
                ),
            ]
    if len(batches) > 1:
        lo, hi = batches[0], batches[-1]
        counts = sorted({v.clients for v in levels})
        lines += [
            "",
            (
                f"max batch {hi} over max batch {lo}: requests/s (wall clock; moves with the machine's "
                f"load), and the server's CPU seconds per request of max batch {lo} over {hi} (the work "
                "batching saves; steadier on a shared machine):"
            ),
            "",
            "| method | " + " | ".join(f"req/s, {c} clients | CPU/request, {c} clients" for c in counts) + " |",
            "|---|" + "---|---|" * len(counts),
        ]
        for method in dict.fromkeys(v.method for v in levels):
            cells = []
            for c in counts:
                if (hi, method, c) in by and (lo, method, c) in by:
                    a, b = by[hi, method, c], by[lo, method, c]
                    cells += [
                        f"{a.requests_per_s / b.requests_per_s:.2f}x",
                        f"{b.server_cpu_s_per_request / a.server_cpu_s_per_request:.2f}x",
                    ]
                else:
                    cells += ["-", "-"]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@contextmanager
def running_server(
    args: argparse.Namespace, max_batch: int, max_clients: int
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rag-kvcache serve --max-batch max_batch` on a free port while in the block: (url, process). It may
    still be loading: `wait_ready` before sending requests."""
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rag_kvcache",
            "serve",
            "--index",
            str(args.work / "index"),
            "--port",
            str(port),
            "--max-queue",
            str(max_clients + 1),
            "--max-tokens",
            str(args.max_tokens),
            "--max-batch",
            str(max_batch),
        ],
        env=env,
    )
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server at {url} did not start (exit status {server.poll()})")
        time.sleep(0.5)


def write_results(out: Path, levels: list[Level], metrics: dict[int, str], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "levels": [asdict(v) for v in levels]}, indent=1))
    for b, text in metrics.items():
        (out / f"metrics-max-batch-{b}.txt").write_text(text)
    (out / "results.md").write_text(markdown(levels, command))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", type=Path, required=True, help="MuSiQue JSON (e.g. musique_dev.json)")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--methods", default="full,cacheblend,epic")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads of each server (on a shared 2-core machine 2 threads made every step 7-12x slower)",
    )
    p.add_argument(
        "--max-batch",
        default="1,8",
        help="the servers' --max-batch values (1: one request at a time); one server each, their levels interleaved",
    )
    p.add_argument("--work", type=Path, default=Path("serve-bench-work"), help="corpus and index (reused)")
    p.add_argument("--out", type=Path, default=Path("serve-bench-out"))
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    methods = args.methods.split(",")

    examples = load_dataset(args.dataset, "musique", top_k=args.top_k)[: args.questions]
    write_corpus(examples, args.work / "docs")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rag_kvcache",
            "index",
            str(args.work / "docs"),
            "--index",
            str(args.work / "index"),
            "--chunk-tokens",
            str(args.chunk_tokens),
        ],
        check=True,
    )
    batches = [int(x) for x in args.max_batch.split(",")]
    command = " ".join(["python", *sys.argv])
    levels: list[Level] = []
    metrics: dict[int, str] = {}
    with ExitStack() as stack:  # one server per max batch, all up at once: their levels interleave in time
        servers = {b: stack.enter_context(running_server(args, b, max(clients))) for b in batches}
        for url, proc in servers.values():  # they load their models at the same time
            wait_ready(url, proc)
        url, _ = servers[batches[0]]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        prompts = []
        for ex in examples:
            hits = httpx.post(f"{url}/v1/retrieve", json={"query": ex.question, "top_k": args.top_k}, timeout=60)
            prompts.append((ex.question, [h["id"] for h in hits.raise_for_status().json()["data"]]))
        for b, (url, proc) in servers.items():
            for method in methods:  # warm-up: one request per method and server, not measured
                asyncio.run(run_level(url, model, prompts[:1], method, 1, 1, args.max_tokens, proc.pid, b))
        for c in clients:
            for method in methods:
                for b, (url, proc) in servers.items():
                    level = asyncio.run(
                        run_level(
                            url, model, prompts, method, c, args.requests_per_client, args.max_tokens, proc.pid, b
                        )
                    )
                    print(
                        f"max batch {b}, {method} x{c}: {level.requests} requests, {level.errors} errors, TTFT "
                        f"p50 {level.ttft_p50_s:.2f} s p99 {level.ttft_p99_s:.2f} s, {level.requests_per_s:.3f} "
                        f"req/s, decode batch {level.mean_decode_batch:.1f}, server CPU {level.server_cpu_s_per_request:.1f} s/request, "
                        f"load average {level.load_average:.1f}",
                        flush=True,
                    )
                    levels.append(level)
                    metrics[b] = httpx.get(f"{url}/metrics").text
                    write_results(args.out, levels, metrics, command)  # what a cut-off run measured is kept
    print(markdown(levels, command))


if __name__ == "__main__":
    main()
