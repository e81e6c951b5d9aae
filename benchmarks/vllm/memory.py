"""Host memory of a vLLM engine with and without `RagKVCacheConnector` (CPU build, SmolLM2-135M, float32).
From the repository root:

    flock /tmp/bench.lock .venv-vllm/bin/python benchmarks/vllm/memory.py WORK_DIR OUT.json

The demo documents are indexed into WORK_DIR/index (reused when there). Each row is a fresh process (and the
engine core and worker processes vLLM starts under it: the CPU platform puts the scheduler's connector and the
worker's in two) that starts `LLM`, answers one RAG prompt over three indexed chunks (`reuse` through the
connector, so the worker runs a method on vLLM's layers) and reports the resident memory (`VmRSS`) and the
peaks (`VmHWM`) summed over its process tree, and the engine's start time. "connector" minus "vLLM alone" is
what the connector costs the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROWS = ("vLLM alone", "connector")


def tree_mib(field: str) -> float:
    """`field` of /proc/PID/status (VmRSS, VmHWM) summed over this process and its descendants (vLLM's engine
    core and worker processes, where the platform starts them), in MiB."""
    total = 0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        total += int(next(x for x in status if x.startswith(field + ":")).split()[1])
    return total / 1024


def child(row: str, work: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads((work / "prompt.json").read_text())
    connector = {
        "kv_connector": "RagKVCacheConnector",
        "kv_connector_module_path": "rag_kvcache.serving.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"index": str(work / "index"), "method": "reuse"},
    }
    before = tree_mib("VmRSS")
    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        gpu_memory_utilization=0.25,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config=connector if row == "connector" else None,
    )
    started = time.perf_counter() - start
    out = llm.generate(TokensPrompt(prompt_token_ids=spec["prompt"]), SamplingParams(max_tokens=1), use_tqdm=False)[0]
    loaded = ((out.kv_transfer_params or {}).get("rag_kvcache") or {}).get("loaded_tokens", 0)
    return {
        "rss_before_mib": before,
        "rss_mib": tree_mib("VmRSS"),
        "peak_mib": tree_mib("VmHWM"),
        "processes": 1 + len(psutil.Process().children(recursive=True)),
        "start_s": started,
        "loaded_tokens": loaded,
        "prompt_tokens": len(spec["prompt"]),
    }


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    import rag_kvcache
    from rag_kvcache.config import Config, IndexSettings
    from rag_kvcache.index import KVIndex

    config = Config(index=IndexSettings(chunk_tokens=128))
    index = KVIndex.build(Path(rag_kvcache.__file__).parent / "demo", work / "index", config, progress=False)
    records = list(index.chunks.all_chunks())
    picked = [next(r for r in records if r.source.endswith(n)) for n in ("harbour.md", "observatory.md", "tessaly.md")]
    fmt = index.format
    question = fmt.question_ids(index.adapter.tokenizer, "What do the documents say about the harbour?")
    prompt = [t for seg in fmt.segments([r.token_ids for r in picked], question) for t in seg.ids]
    model = str(index.adapter.model.name_or_path)
    index.close()
    (work / "prompt.json").write_text(json.dumps({"model": model, "prompt": prompt}))
    results = {}
    for row in ROWS:
        measured = work / f"{row}.json"  # the child's report (its stdout carries vLLM's logs)
        subprocess.run([sys.executable, __file__, "--child", row, str(work), str(measured)], check=True)
        results[row] = json.loads(measured.read_text())
        print(row, results[row], flush=True)
    results["connector minus alone (MiB)"] = {
        k: results["connector"][k] - results["vLLM alone"][k] for k in ("rss_mib", "peak_mib")
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["connector minus alone (MiB)"]))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        Path(sys.argv[4]).write_text(json.dumps(child(sys.argv[2], Path(sys.argv[3]))))
    else:
        main()
