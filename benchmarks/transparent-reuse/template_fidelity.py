"""The quality cost of reading a prompt template's text from a cache: teacher-forced fidelity to `full` of
each method on LlamaIndex's default text-QA layout, with the template text after the chunks read from
the cache the generator learned it into (`FusionConfig.template_text`) and with it computed, on the same
prompts, paired question by question.

`rag-kvcache bench` finds a prompt's chunks once per question, with the index's own settings, and fuses
every method over those segments, so it cannot switch template caching per method; this script builds
the bench's index (`bench.corpus.build_index`, incremental: point `--work` at a bench run's `work/`
folder to reuse it), retrieves and lays out each question as `bench --prompt-style llamaindex` does,
lets the generator see every prompt once (a pipeline in its steady state: the template learned), then
scores each method on both segmentations (`bench.fidelity.fidelity`: full's greedy answer forced through
the method's cache; deterministic, so not timed). Printed: per question the template tokens read from
the cache and the KL per token both ways; per method the mean KL with its 95% bootstrap CI both ways and
the mean paired difference (with - without) with its CI.

    .venv/bin/python benchmarks/transparent-reuse/template_fidelity.py --dataset /work/shared/data/musique_dev.json \\
        --limit 12 --work OUT/work --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rag_kvcache.bench.corpus import build_index, place_evidence
from rag_kvcache.bench.datasets import load_dataset
from rag_kvcache.bench.fidelity import fidelity
from rag_kvcache.bench.metrics import bootstrap_ci
from rag_kvcache.bench.prompts import style_messages
from rag_kvcache.bench.variants import REFERENCE, Variant
from rag_kvcache.config import Config, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.query.generator import FusedGenerator


def _ci(values: np.ndarray) -> str:
    low, high = bootstrap_ci(values)
    return f"[{low:.4f}, {high:.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument(
        "--work", type=Path, required=True, help="The bench's work folder (its index is built or reused)."
    )
    parser.add_argument("--methods", default="cacheblend,reuse", help="Comma-separated methods scored against full.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="Also write every question's scores here.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pid {os.getpid()}, load average at start {os.getloadavg()}", flush=True)
    config = Config(
        index=IndexSettings(chunk_tokens=128),
        query=QueryConfig(top_k=6, generation=GenerationConfig(max_new_tokens=16)),
    )
    examples = load_dataset(args.dataset, top_k=config.query.top_k)[: args.limit]
    index, _ = build_index(examples, args.work, config, ModelAdapter.load(config), progress=False)
    generator = FusedGenerator(index)
    prompts = []
    for example in examples:
        hits, _ = place_evidence(index.search(example.question, config.query.top_k), example)
        prompts.append(style_messages("llamaindex", [h.chunk.text for h in hits], example.question))
    with_template, without = replace(config.query.fusion, template_text=True), config.query.fusion
    for prompt in prompts:  # every prompt seen once: the template learned, its cache stored
        generator.layout.prompt_segments(prompt, with_template)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    variants = [Variant(REFERENCE), *(Variant(m) for m in methods)]
    rows = []
    for example, prompt in zip(examples, prompts):
        row = {"id": example.id}
        for name, fusion in (("with", with_template), ("without", without)):
            segments = generator.layout.prompt_segments(prompt, fusion)
            scores, _ = fidelity({None: generator}, segments, variants, config)
            row[f"template_tokens_{name}"] = sum(len(s.ids) for s in segments if s.label.startswith("template"))
            row |= {f"{v.method}_{key}_{name}": value for v in variants[1:] for key, value in scores[v].items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scored = [r for r in rows if r[f"{methods[0]}_tf_kl_with"] is not None]
    print(
        f"{len(scored)} of {len(rows)} questions scored; template tokens read from cache per prompt: "
        f"{sorted(r['template_tokens_with'] for r in rows)}"
    )
    for method in methods:
        on = np.array([r[f"{method}_tf_kl_with"] for r in scored])
        off = np.array([r[f"{method}_tf_kl_without"] for r in scored])
        print(
            f"{method}: TF KL per token with template cache {on.mean():.4f} {_ci(on)}, without {off.mean():.4f} "
            f"{_ci(off)}; paired difference {np.mean(on - off):+.4f} {_ci(on - off)}"
        )
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
