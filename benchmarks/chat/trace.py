"""Replayed trace of mixed chats and RAG questions at 16 clients through `rag-kvcache serve`: the
cache-aware order against first-come-first-served (issue 36).

Half the clients chat (a first message quoting the documents, then follow-up questions; each turn after
the first reads the chat so far from the conversation cache and computes a few dozen tokens); the other
half send RAG questions with `full` (the chunks retrieved by the server, every token computed the first
time a question is asked: the heavy requests of the trace; six questions, so the others are asked again and
read the first asking's K/V). Each policy gets its own server (`--order fcfs`, every request prefilled oldest
first, or `cache_aware`, requests held by the conversation cache joining the decoding batch at once), the
same trace, one after the other. Per request the client measures the time to the first streamed token
(queueing included); reported: p50, p90, p99 and mean over all requests and per kind.

    python benchmarks/chat/trace.py --index /tmp/chat-idx --out benchmarks/chat/trace-results.json

`--rag-questions FILE` replaces the six questions with the file's lines, each client asking its own in turn.
`--variants` names the servers, each `ORDER` or `ORDER:prefetch` (with the loader that reads waiting requests'
caches into the memory tier, `serve --prefetch`; each variant passes `--prefetch` or `--no-prefetch`, whatever the
server's default). `--kv-remote URL` gives the servers a shared Redis tier (an index whose disk holds no caches then
reads them all from there). With `--rag-method epic_match` (any method that reads chunk caches) and a
`--memory-bytes` smaller than the chunks the trace reads, most RAG questions find their caches on disk only: the
cold trace, where reading caches ahead of a prefill can pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversation import QUESTIONS, Server, build_index  # noqa: E402

RAG_QUESTIONS = (
    "When was the Tessaly lighthouse lit?",
    "Who kept a diary of ships?",
    "What does Saltmere's bakery sell?",
    "How far is Tessaly from Orrin's Ford?",
    "What is the island's only pub called?",
    "Who founded the observatory?",
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(ttfts: list[float]) -> dict[str, float]:
    return {
        "n": len(ttfts),
        "p50_s": percentile(ttfts, 0.5),
        "p90_s": percentile(ttfts, 0.9),
        "p99_s": percentile(ttfts, 0.99),
        "mean_s": statistics.fmean(ttfts),
    }


def counter(server: Server, name: str) -> int:
    """The server's counter `name` (`/metrics`)."""
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=60).text)
    return int(next(s.value for f in families for s in f.samples if s.name == f"{name}_total"))


def run_trace(
    server: Server,
    documents: str,
    clients: int,
    turns: int,
    max_tokens: int,
    rag_method: str,
    rag_question: Callable[[int, int], str],
) -> list[dict]:
    rows: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def record(kind: str, c: int, i: int, ask: Callable[[], dict]) -> dict | None:
        """One request's row (its error in place of its timings when it failed: the client stops there)."""
        try:
            r = ask()
        except Exception as e:
            with lock:
                rows.append({"kind": kind, "client": c, "turn": i + 1, "error": repr(e)})
            return None
        with lock:
            rows.append({"kind": kind, "client": c, "turn": i + 1, **r})
        return r

    def chat(c: int) -> None:
        messages: list[dict] = []
        start.wait()
        for i in range(turns):
            question = f"{QUESTIONS[(c + i) % len(QUESTIONS)]}"
            messages.append(
                {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {question}" if i == 0 else question}
            )
            r = record(
                "chat", c, i, lambda: server.ask(messages, "cacheblend", max_tokens, extra={"cache_salt": f"chat-{c}"})
            )
            if r is None:
                return
            messages.append({"role": "assistant", "content": r["answer"]})

    def rag(c: int) -> None:
        start.wait()
        for i in range(turns):
            messages = [{"role": "user", "content": rag_question(c, i)}]
            if record("rag", c, i, lambda: server.ask(messages, rag_method, max_tokens, extra={"top_k": 3})) is None:
                return

    threads = [threading.Thread(target=chat if c % 2 == 0 else rag, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rag-method", default="full", help="the RAG questions' method")
    parser.add_argument("--rag-questions", type=Path, help="a file of RAG questions, one a line")
    parser.add_argument("--memory-bytes", type=int, help="the servers' memory tier for chunk caches")
    parser.add_argument("--variants", nargs="+", default=["fcfs", "cache_aware"], help="ORDER or ORDER:prefetch")
    parser.add_argument("--kv-remote", help="the servers' shared Redis tier (redis://host:port/db)")
    args = parser.parse_args()
    if not args.index.exists():
        build_index(args.index)
    if args.rag_questions is None:  # six questions asked again and again, client c starting at the c-th
        questions, first = RAG_QUESTIONS, lambda c: c
    else:  # each RAG client (every other client) its own `turns` questions of the file, in turn
        questions, first = tuple(args.rag_questions.read_text().splitlines()), lambda c: c // 2 * args.turns

    def rag_question(c: int, i: int) -> str:
        return questions[(first(c) + i) % len(questions)]

    results = {}
    for variant in args.variants:
        order, _, prefetch = variant.partition(":")
        if prefetch not in ("", "prefetch"):
            parser.error(f"--variants {variant!r}: ORDER or ORDER:prefetch")
        server = Server(
            args.index,
            *("--order", order, "--max-queue", str(args.clients), "--max-per-key", "0"),
            "--prefetch" if prefetch == "prefetch" else "--no-prefetch",
            *(("--memory-bytes", str(args.memory_bytes)) if args.memory_bytes is not None else ()),
            *(("--kv-remote", args.kv_remote) if args.kv_remote else ()),
        )
        try:
            hits = server.retrieve(QUESTIONS[0], 3)
            t0 = time.perf_counter()
            documents = "\n\n".join(h["text"] for h in hits)
            rows = run_trace(
                server, documents, args.clients, args.turns, args.max_tokens, args.rag_method, rag_question
            )
            wall = time.perf_counter() - t0
            joined, prefetched = (
                counter(server, name) for name in ("rag_kvcache_joined_requests", "rag_kvcache_prefetched_caches")
            )
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"the {variant} server exited ({server.proc.returncode}) during the trace: {server.stderr()[-4000:]}"
                )
        finally:
            server.close()
        answered = [r for r in rows if "error" not in r]
        results[variant] = {
            "wall_s": wall,
            "joined": joined,  # requests that joined the decoding batch without a prefill (`cache_aware`)
            "prefetched": prefetched,  # chunk caches read into memory for waiting requests
            "failed": [r for r in rows if "error" in r],
            "all": summary([r["ttft_s"] for r in answered]),
            **{kind: summary([r["ttft_s"] for r in answered if r["kind"] == kind]) for kind in ("chat", "rag")},
            "requests": answered,
        }
        print(variant, json.dumps({k: v for k, v in results[variant].items() if k != "requests"}), flush=True)
    args.out.write_text(json.dumps({"results": results, "command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
