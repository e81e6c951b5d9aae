"""What vLLM's CPU backend hands a KV connector: the paged KV layout `register_kv_caches` gets, and whether
`start_load_kv` / `save_kv_layer` see attention metadata with a slot mapping. Run from the repository root:

    PYTHONPATH=benchmarks/vllm .venv-vllm/bin/python benchmarks/vllm/probe_cpu_backend.py INDEX_DIR OUT.json

(INDEX_DIR: an index of rag_kvcache/demo with 128-token chunks). A subclass of `RagKVCacheConnector` records
what it sees into OUT.json (one line per observation, from the worker process) and checks where the K/V it
wrote landed in the paged tensor."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from rag_kvcache.serving.vllm_connector import RagKVCacheConnector

OUT = os.environ.get("PROBE_OUT", "/tmp/probe.jsonl")


def record(**what: Any) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps(what, default=str) + "\n")


def describe(meta: Any) -> dict[str, Any]:
    if isinstance(meta, dict):
        name, first = next(iter(meta.items()), (None, None))
        return {"type": "dict", "layers": len(meta), "first_layer": name, **describe(first)}
    slots = getattr(meta, "slot_mapping", None)
    return {
        "meta_type": type(meta).__name__,
        "slot_mapping": None if slots is None else [tuple(slots.shape), str(slots.dtype), slots[:8].tolist()],
    }


class ProbeConnector(RagKVCacheConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        name, cache = next(iter(kv_caches.items()))
        record(
            event="register_kv_caches",
            layers=len(kv_caches),
            first=name,
            shape=tuple(cache.shape),
            dtype=str(cache.dtype),
            stride=cache.stride(),
            block_size=self._block_size,
        )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = forward_context.attn_metadata
        record(
            event="start_load_kv",
            loads=len(self._get_connector_metadata().loads),
            attn_metadata=None if meta is None else describe(meta),
            forward_slot_mapping=None
            if forward_context.slot_mapping is None
            else describe(forward_context.slot_mapping),
        )
        super().start_load_kv(forward_context, **kwargs)
        for spec in self._get_connector_metadata().loads:
            segments, inp = self._planner.layout(spec.prompt, spec.fusion)
            kv = self._planner.span_kv(segments, inp, spec.fusion, spec.start, spec.end)
            name, cache = next(iter(self._kv_caches.items()))
            keys, values = kv[0]  # [H_kv, T, D]
            nb, h, bs, d2 = cache.shape
            paged = cache.view(nb, h, 2 * bs, d2 // 2)  # the backend's view: a block's keys, then its values
            t = torch.arange(spec.start, spec.end)
            b = torch.tensor(spec.block_ids)[t // bs]
            o = t % bs
            got_k = paged[b, :, o].transpose(0, 1)  # [H_kv, T, D]
            got_v = paged[b, :, bs + o].transpose(0, 1)
            record(
                event="layout_check",
                tokens=spec.end - spec.start,
                keys_max_err=float((got_k.float() - keys.float()).abs().max()),
                values_max_err=float((got_v.float() - values.float()).abs().max()),
            )

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if layer_name.endswith("layers.0.self_attn.attn"):
            record(
                event="save_kv_layer",
                layer=layer_name,
                kv_layer=tuple(kv_layer.shape),
                attn_metadata=None if attn_metadata is None else describe(attn_metadata),
            )


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rag_kvcache.index import KVIndex

    index_dir, out = sys.argv[1], sys.argv[2]
    os.environ["PROBE_OUT"] = out
    index = KVIndex.open(index_dir)
    chunks = [c.token_ids for c in list(index.chunks.all_chunks())[:3]]
    fmt = index.format
    ids = [
        t for s in fmt.segments(chunks, fmt.question_ids(index.adapter.tokenizer, "Who is mentioned?")) for t in s.ids
    ]
    model = str(index.adapter.model.name_or_path)
    index.close()
    llm = LLM(
        model=model,
        dtype="float32",
        gpu_memory_utilization=0.25,
        enable_prefix_caching=False,
        max_model_len=4096,
        kv_transfer_config={
            "kv_connector": "ProbeConnector",
            "kv_connector_module_path": "probe_cpu_backend",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"index": index_dir, "method": "prefix"},
        },
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
    base = llm.generate(
        TokensPrompt(prompt_token_ids=ids),
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, skip_reading_prefix_cache=True),
    )[0]
    conn = llm.generate(TokensPrompt(prompt_token_ids=ids), params)[0]
    record(
        event="outputs",
        prompt_tokens=len(ids),
        base_text=base.outputs[0].text,
        conn_text=conn.outputs[0].text,
        base_cached=base.num_cached_tokens,
        conn_cached=conn.num_cached_tokens,
        conn_params=conn.kv_transfer_params,
        base_lp={k: v.logprob for k, v in base.outputs[0].logprobs[0].items()},
        conn_lp={k: v.logprob for k, v in conn.outputs[0].logprobs[0].items()},
    )


if __name__ == "__main__":
    main()
