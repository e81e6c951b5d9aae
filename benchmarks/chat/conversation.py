"""A 10-turn chat over indexed documents through `rag-kvcache serve`, with the `openai` client, against
the same conversation sent cold (a server with `--conversation-bytes 0`), issue 36.

The first user message quotes the documents retrieved for its question (a pipeline's own prompt: the
server finds the chunks in it by their token ids); each later turn is a follow-up question after the
answers so far. Both servers receive exactly the same messages at every turn (the cold one is sent the
warm run's answers as the history), so each turn's prompt is the same in both and its answers can be
compared. Per turn: prompt tokens, tokens read from cache (`usage.prompt_tokens_details.cached_tokens`)
and from the conversation cache (the `rag_kvcache` field), the time to the first streamed token as the
client sees it, and the answer.

    python benchmarks/chat/conversation.py --index /tmp/chat-idx --out benchmarks/chat/results.json

The index is built from the packaged demo documents when the folder does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

import httpx
import openai

QUESTIONS = (
    "What is the main telescope of the Veldmark Observatory named?",
    "What kind of telescope is it?",
    "When was it first pointed at the sky?",
    "What did the astronomers record that night?",
    "Who founded the observatory?",
    "Who runs the observatory today?",
    "How often is there a public viewing night?",
    "How many volumes does the logbook fill?",
    "Where is the logbook kept?",
    "What town lies below the observatory?",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float, why: Callable[[], str]) -> None:
    """Until the server at `url` answers 200 on /health; RuntimeError (with `why()`) if `proc` exits first,
    TimeoutError after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {why()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start in {seconds:.0f} s")
        time.sleep(0.5)


class Server:
    """`rag-kvcache serve` in a subprocess on a free loopback port, until closed."""

    def __init__(self, index: Path, *options: str, api_key: str = "unused", code: Path | None = None) -> None:
        """`code`: a checkout whose `rag_kvcache` the server runs (another revision's, for a side-by-side run)."""
        self.port = free_port()
        cli = Path(sys.executable).with_name("rag-kvcache")
        self.log = tempfile.TemporaryFile("w+")  # its stderr: a pipe nobody reads would fill and stall it
        self.proc = subprocess.Popen(
            [str(cli), "serve", "--index", str(index), "--port", str(self.port), *options],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
            env=os.environ | ({"PYTHONPATH": str(code)} if code else {}),
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.proc, self.url, 300, self.stderr)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def retrieve(self, query: str, top_k: int) -> list[dict]:
        return httpx.post(f"{self.url}/v1/retrieve", json={"query": query, "top_k": top_k}, timeout=60).json()["data"]

    def ask(self, messages: list[dict], method: str, max_tokens: int, extra: dict | None = None) -> dict:
        """One streamed turn: time to the first content token, the answer, usage and the fusion's numbers;
        `extra`: `rag_kvcache` options besides the method, and `cache_salt`."""
        extra = dict(extra or {})
        body = {"rag_kvcache": {"method": method, **{k: v for k, v in extra.items() if k != "cache_salt"}}}
        body |= {"cache_salt": extra["cache_salt"]} if "cache_salt" in extra else {}
        t0 = time.perf_counter()
        ttft, pieces, last = None, [], None
        for chunk in self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=body,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                pieces.append(chunk.choices[0].delta.content)
            last = chunk
        extension = last.model_extra.get("rag_kvcache", {})
        ttft = ttft if ttft is not None else time.perf_counter() - t0  # no text: the whole response's time
        return {
            "ttft_s": ttft,
            "answer": "".join(pieces).strip(),
            "prompt_tokens": last.usage.prompt_tokens,
            "cached_tokens": last.usage.prompt_tokens_details.cached_tokens,
            "conversation_tokens": extension.get("conversation_tokens"),
            "dropped_messages": extension.get("dropped_messages"),
            "server_ttft_s": extension.get("ttft_s"),
        }

    def stderr(self) -> str:
        """What the server has written to its stderr so far."""
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def build_index(index: Path) -> None:
    docs = files("rag_kvcache") / "demo"
    cli = Path(sys.executable).with_name("rag-kvcache")
    subprocess.run([str(cli), "index", str(docs), "--index", str(index), "--chunk-tokens", "128"], check=True)


def chat(warm: Server, cold: Server, method: str, turns: int, top_k: int, max_tokens: int) -> list[dict]:
    hits = warm.retrieve(QUESTIONS[0], top_k)
    documents = "\n\n".join(h["text"] for h in hits)
    messages: list[dict] = []
    rows = []
    for i, question in enumerate(QUESTIONS[:turns]):
        content = f"Documents:\n{documents}\n\nQuestion: {question}" if i == 0 else question
        messages.append({"role": "user", "content": content})
        w, c = warm.ask(messages, method, max_tokens), cold.ask(messages, method, max_tokens)
        rows.append({"turn": i + 1, "method": method, "warm": w, "cold": c})
        print(
            f"{method} turn {i + 1:2d}: {w['prompt_tokens']} tokens, cached {w['cached_tokens']} "
            f"(conversation {w['conversation_tokens']}) vs cold {c['cached_tokens']}; TTFT {w['ttft_s'] * 1e3:.0f} ms "
            f"vs cold {c['ttft_s'] * 1e3:.0f} ms; same answer: {w['answer'] == c['answer']}",
            flush=True,
        )
        messages.append({"role": "assistant", "content": w["answer"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="cacheblend,full,prefix")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    if not args.index.exists():
        build_index(args.index)
    warm, cold = Server(args.index), Server(args.index, "--conversation-bytes", "0")
    try:
        rows = [
            row
            for method in args.methods.split(",")
            for row in chat(warm, cold, method, args.turns, args.top_k, args.max_tokens)
        ]
    finally:
        warm.close()
        cold.close()
    summary = {}
    for method in args.methods.split(","):
        mine = [r for r in rows if r["method"] == method]
        last = mine[-1]
        summary[method] = {
            "last_turn_cached_fraction": last["warm"]["cached_tokens"] / last["warm"]["prompt_tokens"],
            "last_turn_cold_cached_fraction": last["cold"]["cached_tokens"] / last["cold"]["prompt_tokens"],
            "last_turn_ttft_speedup": last["cold"]["ttft_s"] / last["warm"]["ttft_s"],
            "median_ttft_speedup_turns_2_on": statistics.median(
                r["cold"]["ttft_s"] / r["warm"]["ttft_s"] for r in mine[1:]
            ),
            "same_answers": sum(r["warm"]["answer"] == r["cold"]["answer"] for r in mine),
            "turns": len(mine),
        }
        print(f"{method}: {json.dumps(summary[method])}")
    args.out.write_text(json.dumps({"summary": summary, "turns": rows, "command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
