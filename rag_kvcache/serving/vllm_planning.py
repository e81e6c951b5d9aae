"""What the vLLM connector (`serving.vllm_connector`) plans with, in its scheduler and its worker alike, without
vLLM: nothing here imports it, so it runs and is tested wherever the package is installed.

`fusion_config` puts a request's `kv_transfer_params` (or the connector's extra config) over the fusion defaults;
`index_config` reads the settings an index folder was built with; `Planner` lays a prompt of token ids out over
an opened index as the embedded engine does and gives the K/V of a span of it (`span_kv`); `loadable_end` is how
many leading prompt tokens the connector provides for a method; `LoadSpec` is one request's load, handed from
the scheduler to the worker."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..config import Config, FusionConfig
from ..engine.fusion import FusionInput
from ..engine.methods import get_method
from ..engine.prompt import Segment, prefix_head
from ..engine.spec import ModelSpec
from ..index import KVIndex
from ..query.generator import FusedGenerator
from ..query.layout import PromptLayout

FUSION_KEYS = frozenset(f.name for f in fields(FusionConfig))


def fusion_config(base: FusionConfig, params: dict[str, Any] | None) -> FusionConfig:
    """`base` with the fusion settings among `params` (a request's `kv_transfer_params` or the connector's
    extra config) put over it; other keys are ignored. Raises ValueError naming a bad method or value."""
    chosen = {k: v for k, v in (params or {}).items() if k in FUSION_KEYS}
    if isinstance(chosen.get("repick_layers"), list):
        chosen["repick_layers"] = tuple(chosen["repick_layers"])
    fusion = replace(base, **chosen)
    get_method(fusion.method)  # an unknown name raises, listing the registered ones
    return fusion


def loadable_end(inp: FusionInput, method: str) -> int:
    """Prompt tokens [0, end) whose K/V the connector provides for `method`: for `prefix`, the leading run
    of exactly cached segments (their caches equal a full prefill's); for any other method that reads
    caches, everything up to the end of the last cached segment (the method fills the gaps); 0 for a
    method that reads none."""
    if not get_method(method).reads_cache:
        return 0
    if method == "prefix":
        end = 0
        for part in inp.parts:
            if part.kv is None or not part.exact:
                break
            end = part.end
        return end
    return max((p.end for p in inp.parts if p.kv is not None), default=0)


def index_config(index_path: Path) -> Config:
    """The settings the index at `index_path` was built with; a clear error when it is not an index."""
    if not (index_path / "index.sqlite").is_file():
        raise ValueError(
            f"kv_connector_extra_config 'index' {str(index_path)!r} is not an index folder "
            "(no index.sqlite): build one with `rag-kvcache index`"
        )
    return KVIndex.config_of(index_path)


class Planner:
    """An opened index and the layout of prompts over it, the same in the scheduler and the worker. The
    scheduler's is over a bare `ModelSpec` (no weights) and opens caches without making any (a missing one is
    `Unmade`); the worker's is over vLLM's own layers (`VllmAdapter`), which make what is missing and run the
    fusion methods. Neither process holds a second copy of the model's weights. Any model that `computes`
    makes and fuses (a `ModelAdapter`, in tests)."""

    def __init__(
        self, index_path: Path, model: ModelSpec, remote: str | None = None, remote_secret: bytes | None = None
    ) -> None:
        """`remote`: the shared KV tier (a Redis URL) the index's caches are also read from, authenticated with
        `remote_secret`, as `rag-kvcache serve --kv-remote` reads them: how replicas share one set of caches."""
        config = index_config(index_path)
        if remote is not None:
            config = config.with_storage(remote=remote, remote_secret=remote_secret)
        self.index = KVIndex.open(index_path, config, adapter=model, rewrite=False, embeds=False)
        self.prompts = PromptLayout(self.index)
        self.generator = FusedGenerator(self.index) if model.computes else None

    def layout(self, ids: list[int], fusion: FusionConfig) -> tuple[list[Segment], FusionInput]:
        """The prompt's segments and their opened caches, as `FusedGenerator` lays out a prompt of ids."""
        segments = self.prompts.find_chunks(prefix_head(ids, self.index.format.prefix_ids), fusion)
        caches = self.index.caches.open(segments, make=self.index.model.computes)
        return segments, FusionInput.build(segments, caches.sources, caches.contexts)

    @torch.inference_mode()
    def span_kv(
        self,
        segments: list[Segment],
        inp: FusionInput,
        fusion: FusionConfig,
        start: int,
        end: int,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K/V [H_kv, end - start, D] of prompt positions [start, end) for `fusion.method`:
        for `prefix` the exact segments' stored caches as they are; for any other method the fused cache
        `FusedGenerator.fuse` makes (the code `ask` runs) on the generator's layers."""
        if fusion.method != "prefix":
            if self.generator is None:
                raise RuntimeError("the scheduler's planner runs no method: the worker's does")
            result = self.generator.fuse(segments, fusion).result
            return [(k[:, start:end], v[:, start:end]) for k, v in zip(result.keys, result.values)]  # [H_kv, T, D]
        out = []
        for layer in range(self.index.model.layout.n_layers):
            keys, values = [], []
            for part in inp.parts:
                if part.end <= start or part.start >= end:
                    continue
                if part.kv is None or not part.exact:
                    raise RuntimeError(
                        f"segment {part.segment.label!r} at [{part.start}, {part.end}) has no exact cache"
                    )
                k, v = part.kv.layer(layer)  # [H_kv, n, D]
                lo, hi = max(start, part.start) - part.start, min(end, part.end) - part.start
                keys.append(k[:, lo:hi])  # [H_kv, hi - lo, D]
                values.append(v[:, lo:hi])
            out.append((torch.cat(keys, dim=1), torch.cat(values, dim=1)))  # [H_kv, end - start, D] x 2
        return out


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, scheduler to worker: prompt positions [start, end) of `prompt` into `block_ids`."""

    req_id: str
    prompt: list[int]
    start: int
    end: int
    block_ids: list[int]
    fusion: FusionConfig
