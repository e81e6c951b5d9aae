"""A real documentation corpus under a disk budget: time to the first answer, and a Zipf stream of questions
through `rag-kvcache serve` against an offline optimum (issue 74).

1. Corpus: the reStructuredText documentation in Django's source distribution on PyPI (`docs/**/*.txt`, about
   6 MB; text nobody here wrote), downloaded and unpacked at run time into `--work` (never committed).
2. Time to the first answer: `rag-kvcache index` on the folder with default settings and `--kv-budget` at
   `--budget-share` (default 10%) of the caches the whole corpus would take; as soon as the index holds its chunks
   (searchable), `rag-kvcache ask` in another process. Compared with embedding the chunks alone (the index's own
   embedder over the same texts, in this process, before the index runs).
3. The stream: `--distinct` questions made from the documentation's section titles, each worded `--wordings` ways,
   drawn Zipf(1) `--draws` times (a wording drawn uniformly each time), sent one at a time through `serve` with the
   server's retrieval (`top_k` 4, the default method, one token: the time to the first token is the measure);
   every `--full-every`-th request is also sent with `method: full`. A thread samples the bytes under the index's
   `kv/` every second. After the stream: the byte hit ratio of the chunk-cache reads the store's ledger logged,
   against Belady's (evict the entry next used furthest in the future) on the same reads from the same start.

    python benchmarks/scale/budget_trace.py --work /tmp/budget-trace --out benchmarks/scale/budget-trace.json

writes the JSON and a plot beside it (`.png`: TTFT over the stream with `full`'s, bytes on disk over time). A
reduced run (`--draws 300 --distinct 100`) takes a fraction of the time and says so in its JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chat"))
from conversation import Server  # noqa: E402

CLI = str(Path(sys.executable).with_name("rag-kvcache"))
DJANGO = "django==5.2"
WORDINGS = (
    "What does the Django documentation say about {t}?",
    "How do I work with {t} in Django?",
    "Explain {t}.",
    "Tell me about {t}.",
    "{t}: what should I know?",
)
TITLE_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+]){3,}\s*$")


def fetch_corpus(work: Path) -> Path:
    """Django's documentation, from its source distribution on PyPI, as plain text files under `work/docs`."""
    docs = work / "docs"
    if docs.is_dir():
        return docs
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", DJANGO, "--no-binary", ":all:", "--no-deps", "-d", str(work)],
        check=True,
    )
    (sdist,) = work.glob("[Dd]jango-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/docs/" in m.name and m.name.endswith(".txt") and m.isfile()]
        for m in members:
            target = docs / m.name.split("/docs/", 1)[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())
    return docs


def titles(docs: Path) -> list[str]:
    """Every section title of the reST files (a line over an underline of its length), each once, in file order."""
    seen: dict[str, None] = {}
    for path in sorted(docs.rglob("*.txt")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for above, line in zip(lines, lines[1:]):
            title = above.strip().strip("`*:")
            if TITLE_UNDERLINE.match(line) and len(line.strip()) >= len(above.strip()) and 8 <= len(title) <= 60:
                if not TITLE_UNDERLINE.match(above) and re.search("[a-z]", title):
                    seen.setdefault(title, None)
    return list(seen)


def zipf_stream(n_distinct: int, draws: int, wordings: int, rng: random.Random) -> list[tuple[int, int]]:
    """`draws` (question, wording) pairs: questions Zipf(1) over `n_distinct` ranks, wordings uniform."""
    weights = [1.0 / (r + 1) for r in range(n_distinct)]
    questions = rng.choices(range(n_distinct), weights=weights, k=draws)
    return [(q, rng.randrange(wordings)) for q in questions]


def belady(accesses: list[tuple[str, int]], budget: int, start: dict[str, int]) -> tuple[int, int]:
    """Bytes hit and bytes read by Belady's policy on `accesses` (key, bytes) within `budget`, from the resident
    set `start` (key -> bytes): on a miss the entry is admitted, evicting the residents next used furthest in the
    future (never again first); an entry used later than every resident is not admitted."""
    INF = math.inf
    next_use: list[float] = [INF] * len(accesses)
    last: dict[str, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        key = accesses[i][0]
        next_use[i] = last.get(key, INF)
        last[key] = i
    upcoming = {key: last.get(key, INF) for key in start}  # each resident's next use from the start
    resident, used = dict(start), sum(start.values())
    hit = total = 0
    for i, (key, size) in enumerate(accesses):
        total += size
        if key in resident:
            hit += resident[key]
            upcoming[key] = next_use[i]
            continue
        if size > budget:
            continue
        victims, freed = [], 0
        for victim in sorted(resident, key=lambda k: upcoming[k], reverse=True):
            if used - freed + size <= budget:
                break
            if upcoming[victim] <= next_use[i]:
                break  # every remaining resident is needed before this entry: do not admit it
            victims.append(victim)
            freed += resident[victim]
        if used - freed + size > budget:
            continue
        for victim in victims:
            del resident[victim], upcoming[victim]
        used += size - freed
        resident[key], upcoming[key] = size, next_use[i]
    return hit, total


def ledger_rows(index: Path, query: str, args: tuple = ()) -> list[tuple]:
    with sqlite3.connect(f"file:{index / 'kv' / 'ledger.sqlite'}?mode=ro", uri=True) as conn:
        return conn.execute(query, args).fetchall()


def chunks_committed(index: Path) -> bool:
    try:
        with sqlite3.connect(f"file:{index / 'index.sqlite'}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0] > 0
    except sqlite3.Error:  # not created yet, or created without its tables so far
        return False


def disk_bytes(root: Path) -> int:
    total = 0
    for path in root.glob("??/*"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # evicted or renamed since the listing
            pass
    return total


def measure_embedding(docs: Path, chunk_tokens: int) -> tuple[float, list[int]]:
    """Seconds to embed the corpus' chunks alone (chunked as the index chunks them, embedded as it embeds them),
    and the chunks' lengths in tokens."""
    from rag_kvcache.config import Config
    from rag_kvcache.engine.model import ModelAdapter
    from rag_kvcache.retrieval.chunking import chunk_document
    from rag_kvcache.retrieval.embedder import chunk_embeddings, load_embedder

    config = Config()
    tokenizer = ModelAdapter.load(config).tokenizer
    chunks = [
        c
        for path in sorted(docs.rglob("*.txt"))
        for c in chunk_document(path.read_text(encoding="utf-8"), str(path), tokenizer, chunk_tokens)
    ]
    texts = [c.text for c in chunks]
    embedder = load_embedder(config.index.embedder, config.runtime.device, config.runtime.embedder_dtype)
    t0 = time.perf_counter()
    chunk_embeddings(embedder, texts, name=config.index.embedder)
    return time.perf_counter() - t0, [len(c.token_ids) for c in chunks]


def first_answer(docs: Path, index: Path, share: float, wait: bool = True) -> tuple[dict, int]:
    """Index `docs` into `index` at default settings within `share` of the caches the whole corpus would take, and
    time it: embedding alone, then the index's time until searchable, its first answer (`ask` in another process
    once the chunks are committed) and its end (`wait=False`: the indexer is stopped after the first answer, its
    passes left to resume). Returns the timings and the budget."""
    from rag_kvcache.config import Config
    from rag_kvcache.index import KVIndex

    chunk_tokens = Config().index.chunk_tokens
    embed_s, lengths = measure_embedding(docs, chunk_tokens)
    n_chunks = len(lengths)
    print(f"embedding the {n_chunks} chunks alone: {embed_s:.0f} s", flush=True)

    # the caches the whole corpus would take at the default settings, as `index` counts them (`KVIndex.kv_bytes`)
    whole = KVIndex.create(index.parent / "probe").kv_bytes(lengths)
    budget = int(share * whole)
    print(f"full caches {whole / 1e9:.1f} GB; budget {budget / 1e9:.2f} GB", flush=True)

    t0 = time.perf_counter()
    indexer = subprocess.Popen([CLI, "index", str(docs), "--index", str(index), "--kv-budget", str(budget)])
    while not chunks_committed(index):  # searchable once the chunks are committed
        if indexer.poll() is not None:
            raise SystemExit(f"index exited with {indexer.returncode} before its chunks were searchable")
        time.sleep(0.5)
    searchable_s = time.perf_counter() - t0
    asked = subprocess.run(
        [CLI, "ask", "How do I define a model field?", "--index", str(index), "--json"], capture_output=True, text=True
    )
    first_answer_s = time.perf_counter() - t0
    if asked.returncode:
        raise SystemExit(asked.stderr)
    print(f"searchable after {searchable_s:.0f} s, first answer after {first_answer_s:.0f} s", flush=True)
    if not wait:
        indexer.terminate()  # an interrupted index keeps what it made; a later `index` resumes
    indexer.wait()
    index_s = time.perf_counter() - t0 if wait else None
    if wait:
        print(f"index done after {index_s:.0f} s", flush=True)
    timings = {
        "chunks": n_chunks,
        "whole_cache_bytes": whole,  # every chunk's caches: the budget is `--budget-share` of this
        "embed_alone_s": embed_s,
        "searchable_s": searchable_s,
        "first_answer_s": first_answer_s,
        "first_answer_over_embedding": first_answer_s / embed_s,
        "index_s": index_s,
    }
    return timings, budget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="folder for the corpus and the index")
    ap.add_argument("--out", type=Path, required=True, help="JSON results (the plot beside it, .png)")
    ap.add_argument("--budget-share", type=float, default=0.10)
    ap.add_argument("--distinct", type=int, default=500)
    ap.add_argument("--wordings", type=int, default=len(WORDINGS))
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--full-every", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=100, help="requests left out of the first half's median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for `rag-kvcache serve` (repeatable; e.g. --serve-option=--backfill-slice --serve-option=inf)",
    )
    ap.add_argument(
        "--stream-only",
        action="store_true",
        help="the index in --work is built (its budget recorded): run the stream alone; the time to the first "
        "answer is then the one an earlier run wrote to --work/first-answer.json, if any",
    )
    ap.add_argument(
        "--first-answer-only",
        action="store_true",
        help="time the embedding and the index until its first answer, write them to --work/first-answer.json, "
        "stop the indexer and end (a fresh --work: the index is built from nothing)",
    )
    ap.add_argument(
        "--from-partial", action="store_true", help="summarize the last run's partial results (a run cut short)"
    )
    args = ap.parse_args()
    if not 0 <= args.warmup < args.draws // 2:
        ap.error(f"--warmup must leave the first half of the {args.draws} draws a request, got {args.warmup}")
    if not 1 <= args.full_every <= args.draws - args.draws // 2:
        ap.error(
            f"--full-every must send the second half of the {args.draws} draws with `full` once, got {args.full_every}"
        )
    args.work.mkdir(parents=True, exist_ok=True)
    docs, index = fetch_corpus(args.work), args.work / "index"
    corpus_bytes = sum(p.stat().st_size for p in docs.rglob("*.txt"))
    print(f"corpus: {corpus_bytes / 1e6:.1f} MB in {sum(1 for _ in docs.rglob('*.txt'))} files", flush=True)

    first = args.work / "first-answer.json"
    if args.stream_only:
        (budget,) = ledger_rows(index, "SELECT value FROM meta WHERE name = 'budget'")[0]
        timings = json.loads(first.read_text()) if first.exists() else {}
    else:
        timings, budget = first_answer(docs, index, args.budget_share, wait=not args.first_answer_only)
        first.write_text(json.dumps(timings, indent=1))
        if args.first_answer_only:
            print(json.dumps(timings, indent=1))
            return
    budget = int(budget)
    if args.from_partial:
        p = json.loads(args.out.with_suffix(".partial.json").read_text())
        summarize(
            p["rows"],
            p["disk_samples"],
            p["trace_t0"],
            p["start"],
            budget,
            index,
            timings,
            args.distinct,
            corpus_bytes,
            args,
        )
        return
    rng = random.Random(args.seed)
    all_titles = titles(docs)
    chosen = rng.sample(all_titles, min(args.distinct, len(all_titles)))
    stream = zipf_stream(len(chosen), args.draws, args.wordings, rng)
    server = Server(index, *args.serve_option)
    kv = index / "kv"
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), disk_bytes(kv)))
            stop.wait(1.0)

    start_keys = dict(ledger_rows(index, "SELECT key, bytes FROM entries"))
    trace_t0 = time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rows = []
    try:
        for i, (q, w) in enumerate(stream):
            question = WORDINGS[w].format(t=chosen[q])
            messages = [{"role": "user", "content": question}]
            got = server.ask(messages, "epic_match", 1, extra={"top_k": 4})
            row = {"i": i, "question": q, "wording": w, "ttft_s": got["ttft_s"], "cached": got["cached_tokens"]}
            row["prompt_tokens"] = got["prompt_tokens"]
            row["server_ttft_s"] = got["server_ttft_s"]  # from the fusion's start: no wait for the server's thread
            if i % args.full_every == 0:
                full = server.ask(messages, "full", 1, extra={"top_k": 4})
                row["full_ttft_s"], row["full_server_ttft_s"] = full["ttft_s"], full["server_ttft_s"]
            rows.append(row)
            if i % 50 == 0:
                print(f"{i}/{len(stream)}: ttft {got['ttft_s']:.2f} s, disk {samples[-1][1] / 1e9:.2f} GB", flush=True)
                partial = {"rows": rows, "disk_samples": samples, "trace_t0": trace_t0, "start": start_keys}
                args.out.with_suffix(".partial.json").write_text(json.dumps(partial))
    finally:
        stop.set()
        sampler.join()
        server.proc.terminate()
        server.proc.wait()

    summarize(rows, samples, trace_t0, start_keys, budget, index, timings, len(chosen), corpus_bytes, args)


def summarize(
    rows: list[dict],
    samples: list,
    trace_t0: float,
    start_keys: dict[str, int],
    budget: int,
    index: Path,
    timings: dict,
    distinct: int,
    corpus_bytes: int,
    args: argparse.Namespace,
) -> None:
    """The stream's figures (`rows` of requests, `samples` of disk bytes) against Belady's on the ledger's reads
    since `trace_t0` from the resident set `start_keys`; written to `args.out` and plotted beside it."""
    accesses = [
        (k, b)
        for k, b in ledger_rows(index, "SELECT key, bytes FROM accesses WHERE t >= ? ORDER BY rowid", (trace_t0,))
    ]
    hits = ledger_rows(index, "SELECT SUM(bytes * hit), SUM(bytes) FROM accesses WHERE t >= ?", (trace_t0,))[0]
    optimum = belady(accesses, budget, start_keys)
    half = len(rows) // 2
    first = [r["ttft_s"] for r in rows[args.warmup : half]]
    second = [r["ttft_s"] for r in rows[half:]]
    full = [r["full_ttft_s"] for r in rows if "full_ttft_s" in r]
    sampled = [r for r in rows[half:] if "full_ttft_s" in r]  # the second half's requests also sent with `full`
    full_second = [r["full_ttft_s"] for r in sampled]
    import rag_kvcache  # the package the server ran: the same PYTHONPATH

    code = Path(rag_kvcache.__file__).parent
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True)
    result = {
        "commit": commit.stdout.strip() or None,  # of the server's code
        "serve_options": args.serve_option,
        "reduced": len(rows) < 2000 or distinct < 500,
        "corpus_mb": corpus_bytes / 1e6,
        "budget_bytes": budget,
        **timings,
        "draws": len(rows),
        "distinct": distinct,
        "median_ttft_first_half_s": statistics.median(first),
        "median_ttft_second_half_s": statistics.median(second),
        "median_full_ttft_s": statistics.median(full),
        "median_full_ttft_second_half_s": statistics.median(full_second),
        "speedup_second_half": statistics.median(full_second) / statistics.median(second),
        "second_over_first_half": statistics.median(second) / statistics.median(first),
        # the same, timed by the server from each fusion's start: without the wait for work already on its thread
        # (a `full` request follows a default one of the same prompt, whose missing caches the server makes first)
        "server_speedup_second_half": (
            statistics.median(r["full_server_ttft_s"] for r in sampled)
            / statistics.median(r["server_ttft_s"] for r in rows[half:])
            if all("server_ttft_s" in r for r in rows)  # a partial run of an older script lacks them
            else None
        ),
        "max_disk_bytes": max(b for _, b in samples),
        "byte_hit_ratio": hits[0] / hits[1] if hits[1] else 0.0,
        "belady_byte_hit_ratio": optimum[0] / optimum[1] if optimum[1] else 0.0,
        "trace_t0": trace_t0,  # the stream's start (Unix seconds): its reads in the ledger's access log follow it
        "rows": rows,
        "disk_samples": [(t - trace_t0, b) for t, b in samples],
    }
    result["hit_ratio_of_belady"] = result["byte_hit_ratio"] / result["belady_byte_hit_ratio"]
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "disk_samples")}, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7))
    top.scatter([r["i"] for r in rows], [r["ttft_s"] for r in rows], s=4, alpha=0.4, label="epic_match (default)")
    full = [(r["i"], r["full_ttft_s"]) for r in rows if "full_ttft_s" in r]
    top.scatter(*zip(*full), s=10, color="tab:red", label="full, same prompts")
    window = 50
    medians = [statistics.median(r["ttft_s"] for r in rows[max(0, i - window) : i + 1]) for i in range(len(rows))]
    top.plot(range(len(rows)), medians, color="black", label=f"median of the last {window}")
    top.set_yscale("log")
    top.set(
        xlabel="request",
        ylabel="time to first token (s)",
        title="Zipf(1) questions, disk budget 10% of the corpus' caches",
    )
    top.legend(fontsize=8)
    seconds, nbytes = zip(*result["disk_samples"])
    bottom.plot(seconds, [b / 1e9 for b in nbytes], label="chunk caches on disk")
    bottom.axhline(result["budget_bytes"] / 1e9, color="tab:red", linestyle="--", label="budget")
    bottom.set(xlabel="seconds into the stream", ylabel="GB")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
