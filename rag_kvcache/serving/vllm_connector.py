"""`RagKVCacheConnector`: rag-kvcache's chunk caches served inside vLLM, as a KV connector.

The only module of the package that imports vLLM (what it plans with, which needs none, is `serving.vllm_planning`).
Named in vLLM's `--kv-transfer-config`:

    vllm serve MODEL_DIR --kv-transfer-config '{"kv_connector": "RagKVCacheConnector",
      "kv_connector_module_path": "rag_kvcache.serving.vllm_connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"index": "IDX", "method": "prefix"}}'

`index` is a folder `rag-kvcache index` built; `method` (default `prefix`) and any `FusionConfig` field
(`ratio`, `epic_k`, ...) are the defaults, which a request overrides through its `kv_transfer_params`
(OpenAI API: `extra_body={"kv_transfer_params": {"method": "reuse"}}`); `kv_remote` (a Redis URL) reads
the caches from the shared tier too (the secret from `RAG_KVCACHE_KV_REMOTE_SECRET`, as the CLI's).

Scheduler side: the request's prompt token ids are laid out as the embedded engine lays out any prompt
(`PromptLayout.find_chunks`: the system prefix's head, the indexed chunks found by their token ids, the
index's caches opened by `KVIndex.caches.open` without making a missing one, `FusionInput.build`), and the
tokens from the start of the prompt to the end of the span the method provides are reported as matched
(`loadable_end`); vLLM computes the rest. The scheduler holds the model's spec alone (tokenizer, shape,
fingerprint streamed from the checkpoint: `ModelSpec.load`), never its weights. Worker side (`start_load_kv`,
synchronous, before the step's forward): the same layout is made again from the same ids, the span's K/V
are produced, and vLLM's own cache writer for each attention layer (`impl.do_kv_cache_update`, the call its
attention layers make) writes them into the paged KV cache through the slots of the request's blocks.

- `prefix` (exact): the exactly cached head (system prefix, and the first chunk right behind it) is copied
  as stored; no model runs.
- every other method that reads caches (`reuse`, `cacheblend`, `epic`, `epic_match`, ...): the method runs
  on **vLLM's own layers** (`FusedGenerator.fuse`, the code `ask` runs, over `engine.vllm_model.VllmAdapter`
  of the model the worker loaded) and its fused K/V up to the end of the last cached span are written;
  vLLM computes the question over them. vLLM hands a connector its caches and attention layers, never the
  model: `register_kv_caches` takes it from the model runner that registers the caches (`_loaded_model`).
  A cache missing from the store is made there too, on vLLM's layers, and stored.

A load that fails in the worker reports the request's blocks as failed (`get_block_ids_with_load_errors`):
with `kv_load_failure_policy: recompute` vLLM prefills them itself; with its default (`fail`) the request
fails. Nothing half-written is ever served as a hit.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from ..config import FusionConfig
from ..engine.methods import get_method
from ..engine.sources import resolve_model_source
from ..engine.spec import ModelSpec
from ..engine.vllm_model import VllmAdapter
from .vllm_planning import LoadSpec, Planner, fusion_config, index_config, loadable_end

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class RagKVCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class _Load:
    """A live request's load: the prompt tokens the worker was asked to write, into which blocks, and whether
    it reported them failed (`update_connector_output`)."""

    tokens: int
    blocks: frozenset[int]
    failed: bool = False


@dataclass(frozen=True)
class _Match:
    end: int  # prompt tokens [0, end) the connector provides
    exact_end: int  # of which [0, exact_end) equal a full prefill's K/V (the leading exactly cached segments)
    fusion: FusionConfig


def _loaded_model(kv_caches: dict[str, torch.Tensor], vllm_config: VllmConfig) -> torch.nn.Module:
    """The model this worker loaded. vLLM 0.32 hands a connector its paged caches and attention layers, never
    the model; the model runner registering the caches (a caller of `register_kv_caches`) holds it, so it is
    taken from the first caller up the stack with a `get_model()`, and accepted only if the attention layer
    of every registered cache is that model's module of the same name."""
    attention = vllm_config.compilation_config.static_forward_context  # layer name -> vLLM's Attention module
    frame = sys._getframe(1)
    while frame is not None:
        runner = frame.f_locals.get("self")
        if callable(getattr(runner, "get_model", None)):
            model = runner.get_model()
            modules = dict(model.named_modules())
            if all(modules.get(name) is attention.get(name) is not None for name in kv_caches):
                return model
        frame = frame.f_back
    raise RuntimeError(
        f"no model runner up the call stack of register_kv_caches holds the attention layers of "
        f"{sorted(kv_caches)[:3]}...: this vLLM registers KV caches in a way the connector does not know"
    )


class RagKVCacheConnector(KVConnectorBase_V1):
    """Reads rag-kvcache chunk caches into vLLM's paged KV cache (see the module's docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "index" not in extra:
            raise ValueError(
                f"RagKVCacheConnector needs kv_connector_extra_config 'index' (an index folder); got {extra!r}"
            )
        self._defaults = fusion_config(FusionConfig(method="prefix"), extra)
        self._block_size = vllm_config.cache_config.block_size
        secret = os.environ.get("RAG_KVCACHE_KV_REMOTE_SECRET")  # as the CLI reads it: never from a config file
        self._index_path = Path(extra["index"]).expanduser()
        self._remote = extra.get("kv_remote"), secret and secret.encode()
        config = index_config(self._index_path)
        self._spec = ModelSpec.load(config)  # tokenizer, shape and fingerprint: no weights
        built = resolve_model_source(config.index.model, config.runtime.cache_dir)
        served = Path(vllm_config.model_config.model).expanduser()
        if served.is_dir() and isinstance(built, Path) and served.resolve() != built.resolve():
            log.warning(
                "vLLM serves %s but index %s was built with %s: unless they are the same weights, every "
                "cache read is wrong",
                served,
                extra["index"],
                built,
            )
        # the scheduler's planner now; the worker's once vLLM has loaded the model (`register_kv_caches`)
        scheduler = role == KVConnectorRole.SCHEDULER
        self._planner: Planner | None = Planner(self._index_path, self._spec, *self._remote) if scheduler else None
        # scheduler side
        self._matches: dict[str, _Match] = {}  # per request: what get_num_new_matched_tokens found
        self._pending: dict[str, tuple[Request, int, int]] = {}  # request, start, end: to load at its next step
        self._loads: dict[str, _Load] = {}  # per live request: the load the worker was asked for
        self._block_pool: BlockPool | None = None  # vLLM's, to take inexact blocks out of its prefix cache
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._failed_blocks: set[int] = set()
        log.info("RagKVCacheConnector (%s) over index %s, method %s", role.name, extra["index"], self._defaults.method)

    def _planned(self) -> Planner:
        if self._planner is None:
            raise RuntimeError(
                f"the {self._role.name} connector has no planner (a worker's comes with register_kv_caches)"
            )
        return self._planner

    # ---- scheduler side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        match = self._match(request)
        if match is None or match.end <= num_computed_tokens:
            return 0, False
        return match.end - num_computed_tokens, False

    def _match(self, request: Request) -> _Match | None:
        """The span of the request's prompt the connector provides (memoised per request); None when the
        request's own fusion settings are bad (logged: vLLM prefills it)."""
        if request.request_id in self._matches:
            return self._matches[request.request_id]
        ids = list(request.prompt_token_ids or [])
        try:
            fusion = fusion_config(self._defaults, request.kv_transfer_params)
        except (TypeError, ValueError) as err:
            log.warning(
                "request %s: bad kv_transfer_params %r (%s); prefilled by vLLM alone",
                request.request_id,
                request.kv_transfer_params,
                err,
            )
            return None
        try:
            reads = len(ids) > 1 and get_method(fusion.method).reads_cache  # `full` reads nothing: no layout either
            inp = self._planned().layout(ids, fusion)[1] if reads else None
            end = 0 if inp is None else loadable_end(inp, fusion.method)
            exact_end = 0 if inp is None else min(end, loadable_end(inp, "prefix"))
        except Exception:  # a fault in the index (an unreadable database, a cache that cannot be recomputed)
            log.exception(
                "request %s: laying its prompt out over the index failed; prefilled by vLLM alone", request.request_id
            )  # fails this request's reuse, never the engine's scheduler
            return None
        self._matches[request.request_id] = match = _Match(end, exact_end, fusion)
        log.debug(
            "request %s: %d of %d prompt tokens from rag-kvcache (%s)", request.request_id, end, len(ids), fusion.method
        )
        return match

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._block_pool = gpu_block_pool

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        match = self._matches[request.request_id]
        self._pending[request.request_id] = (request, match.end - num_external_tokens, match.end)
        self._forget_inexact(match, blocks.get_block_ids()[0])

    def _forget_inexact(self, match: _Match, block_ids: list[int]) -> None:
        """Take the request's blocks from the first one holding a fused (inexact) token onwards out of vLLM's
        prefix cache, which registered them under their tokens' hashes: another prompt sharing those tokens
        would read this prompt's approximation (fused K/V depend on the whole prompt, and every later block's
        K/V on them). Called when the blocks are allocated (vLLM has just hashed the loaded span) and when the
        request finishes (the blocks vLLM computed over them)."""
        if match.exact_end < match.end and self._block_pool is not None:
            self._block_pool.evict_blocks(set(block_ids[match.exact_end // self._block_size :]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagKVCacheMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._pending:
                self._add_load(meta, new.req_id, new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if req_id in self._pending and req_id in cached.resumed_req_ids and blocks is not None:
                self._add_load(meta, req_id, blocks[0])  # a resumed request's new blocks are all of its blocks
        if self._pending:
            raise RuntimeError(f"requests {sorted(self._pending)} were allocated a load but not scheduled")
        return meta

    def _add_load(self, meta: RagKVCacheMetadata, req_id: str, block_ids: list[int]) -> None:
        request, start, end = self._pending.pop(req_id)
        fusion = self._matches[req_id].fusion
        meta.loads.append(LoadSpec(req_id, list(request.prompt_token_ids or []), start, end, list(block_ids), fusion))
        self._loads[req_id] = _Load(end - start, frozenset(block_ids))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Note the live requests whose load the worker reported failed (their blocks among
        `invalid_block_ids`): vLLM recomputes those blocks, and the request's output says so."""
        if invalid := connector_output.invalid_block_ids:
            for load in self._loads.values():
                load.failed = load.failed or bool(load.blocks & invalid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its output's `kv_transfer_params` say how many prompt tokens came from rag-kvcache
        (none when the worker's load failed and vLLM recomputed them: `load_failed`)."""
        match = self._matches.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)
        if match is None:
            return False, None
        if load is not None:
            self._forget_inexact(match, block_ids)
        failed = load is not None and load.failed
        return False, {
            "rag_kvcache": {
                "method": match.fusion.method,
                "loaded_tokens": 0 if load is None or failed else load.tokens,
                "load_failed": failed,
                "matched_end": match.end,
            }
        }

    # ---- worker side ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self._spec.layout
        if len(kv_caches) != layout.n_layers:
            raise ValueError(
                f"vLLM has {len(kv_caches)} KV cache layers, the index's model {layout.n_layers}: "
                "serve the model the index was built with"
            )
        self._kv_caches = kv_caches
        model = VllmAdapter(_loaded_model(kv_caches, self._vllm_config), self._spec)
        self._planner = Planner(self._index_path, model, *self._remote)
        name, cache = next(iter(kv_caches.items()))
        log.info(
            "vLLM paged KV cache: %d layers like %s, shape %s, dtype %s, block size %d; the methods run on "
            "vLLM's layers",
            len(kv_caches),
            name,
            tuple(cache.shape),
            cache.dtype,
            self._block_size,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagKVCacheMetadata):
            raise TypeError(f"RagKVCacheConnector got metadata of type {type(meta).__name__}")
        for spec in meta.loads:
            try:
                self._load(forward_context, spec)
            except Exception:  # a failed load is recomputed by vLLM (or fails the request), never served
                log.exception(
                    "loading %d tokens of request %s failed; its blocks are reported failed",
                    spec.end - spec.start,
                    spec.req_id,
                )
                first, last = spec.start // self._block_size, (spec.end - 1) // self._block_size
                self._failed_blocks.update(spec.block_ids[first : last + 1])

    def _load(self, forward_context: ForwardContext, spec: LoadSpec) -> None:
        segments, inp = self._planned().layout(spec.prompt, spec.fusion)
        if (end := loadable_end(inp, spec.fusion.method)) != spec.end:
            raise RuntimeError(
                f"the worker finds {end} loadable tokens where the scheduler found {spec.end} "
                "(the index changed in between?)"
            )
        kv = self._planned().span_kv(segments, inp, spec.fusion, spec.start, spec.end)
        device = next(iter(self._kv_caches.values())).device
        positions = torch.arange(spec.start, spec.end)  # [T]
        blocks = torch.tensor(spec.block_ids, dtype=torch.long)[positions // self._block_size]  # [T]
        slots = (blocks * self._block_size + positions % self._block_size).to(device)  # [T]
        for name, cache in self._kv_caches.items():
            layer = forward_context.no_compile_layers[name]
            keys, values = kv[extract_layer_index(name)]  # [H_kv, T, D]
            layer.impl.do_kv_cache_update(  # vLLM's own writer: the paged layout is the backend's business
                layer,
                keys.transpose(0, 1).to(device, cache.dtype).contiguous(),  # [T, H_kv, D]
                values.transpose(0, 1).to(device, cache.dtype).contiguous(),  # [T, H_kv, D]
                cache,
                slots,
            )
        log.debug(
            "request %s: wrote K/V of prompt positions [%d, %d) (%s)",
            spec.req_id,
            spec.start,
            spec.end,
            spec.fusion.method,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # chunk caches are made by `rag-kvcache index`, not from vLLM's prefills

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
