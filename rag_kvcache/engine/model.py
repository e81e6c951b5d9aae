"""Model adapter: the only module that touches transformers internals.

`ModelSpec` is a model without its weights: tokenizer, KV layout, RoPE tables and the fingerprint every cache
key carries, read from the checkpoint (what the vLLM connector's processes hold beside vLLM's own weights).
`ModelAdapter` loads a Hugging Face causal LM (from where `sources.resolve_model_source` finds it), refuses what
cannot be fused exactly, and exposes the
per-layer pieces the fusion engine needs (`embed`, `attention_input`, `qkv` or `kv` and `q`, `finish`,
`logits`; projections that share an input fused into one, `LayerWeights`), a reference
prefill, the indexing prefill of many chunks packed into one forward (`prefill_packed`), an
injected-cache decode step, and batched steps over sequences whose caches are slots of a `DecodePool`
(`decode_rows`, one token a row; `extend_rows`, several).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    DynamicCache,
    PreTrainedModel,
    StaticCache,
)

from ..config import Config
from .decoding import DecodeCache, RowStep, attend_rows
from .graphs import LayerGraphs
from .ops import apply_rope, rope_cos_sin
from .sources import resolve_model_source
from .spec import (
    DTYPES,
    ModelSpec,
    check_supported,
    weights_fingerprint,
)
from .weights import NARROW_ROWS, LayerWeights, narrow_is_faster, narrow_product

log = logging.getLogger(__name__)


class ModelAdapter(ModelSpec):
    """A loaded causal LM (transformers) with the per-layer hooks the fusion engine drives."""

    computes = True

    def __init__(
        self, model: PreTrainedModel, tokenizer, name: str, graphs: int = 0, narrow: bool | None = None
    ) -> None:
        """`graphs`: on CUDA, how many captured settled-layer steps to keep (`graphs.LayerGraphs`; 0: none,
        every layer op by op); elsewhere unused. `narrow`: whether products over at most `NARROW_ROWS` rows take
        `narrow_product`'s form; None: on a CPU, where this machine computes the LM head faster so
        (`narrow_is_faster`), the largest weight a decoding step reads."""
        check_supported(model)
        weight = next(model.parameters())
        super().__init__(
            model.config,
            model.generation_config,
            tokenizer,
            name,
            weights_fingerprint(model.config, weight.dtype, model.named_parameters()),
            weight.dtype,
            weight.device,
            model.model.rotary_emb.inv_freq.detach().to(torch.float32),  # [D/2]
            model.model.layers[0].self_attn.scaling,
        )
        self.model = model.eval()
        cfg = model.config
        self.silu = cfg.hidden_act == "silu"  # the MLP's activation, applied in place (`gated`)
        self.act_fn = model.model.layers[0].mlp.act_fn
        self.layers = [LayerWeights.of(block) for block in model.model.layers]  # fused projections, once
        # the forward's cache argument (and its output's field): `cache` since transformers 5.2x, `past_key_values`
        # before (vLLM's CPU build pins 5.19); the old name is deprecated, with a FutureWarning on every call
        self.cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.graphs = LayerGraphs(self, graphs) if graphs and self.device.type == "cuda" else None
        if narrow is None:
            narrow = self.device.type == "cpu" and narrow_is_faster(model.lm_head.weight.detach().t())
            log.info("decoding steps' products: %s", "narrow_product" if narrow else "torch.mm")
        self.narrow = narrow

    @classmethod
    def load(cls, config: Config) -> ModelAdapter:
        source = resolve_model_source(config.index.model, config.runtime.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=DTYPES[config.index.dtype], attn_implementation="sdpa"
        )
        return cls(model.to(config.runtime.device), tokenizer, config.index.model, config.runtime.cuda_graphs)

    # ---- per-layer pieces for the fusion engine -------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)  # [T, E]

    def qkv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [H_q, T, D], k [H_kv, T, D] and v [H_kv, T, D] of one layer from its `attention_input`
        x [T, E], in one projection; q and k rotated in one `apply_rope` (cos/sin: `rope_cos_sin` tables [T, D]
        in the model's dtype)."""
        w = self.layers[layer]
        h_q = w.n_q // self.head_dim
        y = self.project(x, w.qkv, w.qkv_bias).view(x.shape[0], -1, self.head_dim)  # [T, H_q + 2 H_kv, D]
        h_qk = h_q + self.layout.n_kv_heads
        v = y[:, h_qk:].transpose(0, 1)  # [H_kv, T, D]
        if w.q_norm is not None:  # Qwen3 normalises each head before RoPE
            q = apply_rope(w.q_norm(y[:, :h_q]).transpose(0, 1), cos, sin)  # [H_q, T, D]
            return q, apply_rope(w.k_norm(y[:, h_q:h_qk]).transpose(0, 1), cos, sin), v  # k [H_kv, T, D]
        qk = apply_rope(y[:, :h_qk].transpose(0, 1), cos, sin)  # [H_q + H_kv, T, D]
        return qk[:h_q], qk[h_q:], v

    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """What one layer's projections read: the normalised hidden states [T, E]."""
        w = self.layers[layer]
        return F.rms_norm(h, w.input_norm.shape, w.input_norm, w.eps)  # [T, E]

    def kv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated k [H_kv, T, D] and v [H_kv, T, D] of one layer from its `attention_input` x [T, E], in one
        projection (the k and v columns of the fused weight)."""
        w = self.layers[layer]
        bias = None if w.qkv_bias is None else w.qkv_bias[w.n_q :]  # [2 H_kv * D]
        y = self.project(x, w.qkv[:, w.n_q :], bias).view(x.shape[0], 2, -1, self.head_dim)  # [T, 2, H_kv, D]
        k = y[:, 0] if w.k_norm is None else w.k_norm(y[:, 0])  # [T, H_kv, D]
        return apply_rope(k.transpose(0, 1), cos, sin), y[:, 1].transpose(0, 1)  # [H_kv, T, D], [H_kv, T, D]

    def q(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated q [H_q, T, D] of one layer from its `attention_input` x [T, E] (the fusion projects it
        only for the tokens that go on through the layer's attention)."""
        w = self.layers[layer]
        bias = None if w.qkv_bias is None else w.qkv_bias[: w.n_q]  # [H_q * D]
        q = self.project(x, w.qkv[:, : w.n_q], bias).view(x.shape[0], -1, self.head_dim)  # [T, H_q, D]
        if w.q_norm is not None:
            q = w.q_norm(q)  # [T, H_q, D]
        return apply_rope(q.transpose(0, 1), cos, sin)  # [H_q, T, D]

    def project(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, in] times a transposed weight [in, out], plus bias [out] and `residual` [T, out]: one kernel
        (`addmm` adds them), or `narrow_product` for a few rows where this adapter takes it (`narrow`)."""
        base = bias if residual is None else (residual if bias is None else residual + bias)  # [T, out] or [out]
        if self.narrow and x.shape[0] <= NARROW_ROWS:
            y = narrow_product(x, weight)  # [T, out]
            return y if base is None else y.add_(base)
        return torch.mm(x, weight) if base is None else torch.addmm(base, x, weight)  # [T, out]

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP of one layer: [T, E] -> [T, E]. Each residual is added by
        the projection's own kernel (`project`)."""
        w = self.layers[layer]
        h = self.project(attn_out, w.o, w.o_bias, h)  # [T, E]
        act = self.gated(layer, F.rms_norm(h, w.post_norm.shape, w.post_norm, w.eps))  # [T, I]
        return self.project(act, w.down, w.down_bias, h)  # [T, E]

    def gated(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """One layer's gated MLP up to its down projection, act(gate(x)) * up(x), [T, E] -> [T, I]: gate and up
        in one projection, the activation (SiLU) and the product written in place into its gate half."""
        w = self.layers[layer]
        gate_up = self.project(x, w.gate_up, w.gate_up_bias)  # [T, 2 I]
        gate, up = gate_up.chunk(2, dim=1)  # [T, I] x 2, views
        gate = F.silu(gate, inplace=True) if self.silu else self.act_fn(gate)  # [T, I]
        return gate.mul_(up)  # [T, I]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        return self.project(self.model.model.norm(h), head.weight.t(), head.bias).float()  # [T, V]

    # ---- reference prefill and decoding -----------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, ids: torch.Tensor, past: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Ordinary transformers forward over ids [B, T] (optionally after a cached past).

        Returns the new tokens' keys and values per layer [B, H_kv, T, D] and the last token's
        logits [B, V].
        """
        start = 0 if past is None else past[0][0].shape[-2]
        cache = None if past is None else self.make_cache(*past)
        positions = torch.arange(start, start + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: DynamicCache() if cache is None else cache},
        )
        layers = getattr(out, self.cache_arg).layers
        keys = [layer.keys[..., start:, :] for layer in layers]  # L x [B, H_kv, T, D]
        values = [layer.values[..., start:, :] for layer in layers]  # L x [B, H_kv, T, D]
        return keys, values, out.logits[:, -1].float()

    def make_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor], room: int = 0) -> Cache:
        """A transformers cache holding the given per-layer K/V [B, H_kv, T, D] (or [H_kv, T, D]).

        With `room` > 0 it is a static cache allocated once for T + `room` positions, which decoding
        fills in place; a dynamic cache copies the whole prompt's K/V again at every token it adds.
        """
        batched = [(k if k.dim() == 4 else k[None], v if v.dim() == 4 else v[None]) for k, v in zip(keys, values)]
        if room == 0:
            return DynamicCache(ddp_cache_data=batched)
        cache = StaticCache(config=self.model.config, max_cache_len=batched[0][0].shape[-2] + room)
        for layer, (k, v) in enumerate(batched):
            cache.update(k, v, layer)  # allocates [B, H_kv, T + room, D] and writes the first T positions
        return cache

    @torch.inference_mode()
    def decode(self, tokens: list[int], cache: Cache, position: int) -> torch.Tensor:
        """Feed `tokens` (at `position` onwards) through an injected cache, which they extend;
        returns the next-token logits after each of them [T, V]."""
        out = self.model(
            input_ids=torch.tensor([tokens], device=self.device),
            position_ids=torch.arange(position, position + len(tokens), device=self.device)[None],
            use_cache=True,
            **{self.cache_arg: cache},
        )
        return out.logits[0].float()  # [T, V]

    def decode_rows(self, tokens: Sequence[int], caches: Sequence[DecodeCache]) -> torch.Tensor:
        """One decoding step for B sequences at once: `tokens[b]` is fed at position `caches[b].length`
        over cache b, which it extends (`extend_rows` with one token a row). Returns the next-token
        logits [B, V]."""
        return self.extend_rows([[t] for t in tokens], caches)

    @torch.inference_mode()
    def extend_rows(
        self, tokens: Sequence[Sequence[int]], caches: Sequence[DecodeCache], keep: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Feed `tokens[b]` (>= 1 of them; rows may differ in length) to each of B sequences at once, at
        positions `caches[b].length` onwards over cache b, which they extend. Embedding, projections, MLPs
        and LM head run once over every row's tokens (the weights are read once for all rows); the rows of
        one `DecodePool` fed as many tokens attend in one call a layer, each over its own positions alone
        (`attend_rows`), so a row's logits do not depend on the other rows: a decoding step's one-token rows
        and a prompt's uncached tail share the step. Returns the logits after each row's last token [B, V];
        with `keep`, after each of row b's last `keep[b]` tokens, row after row [sum keep, V] (a draft verified)."""
        if not tokens or len(tokens) != len(caches):
            raise ValueError(
                f"extend_rows needs one row of tokens per cache, got {len(tokens)} rows for {len(caches)} caches"
            )
        widths = [len(row) for row in tokens]
        if min(widths) == 0:
            raise ValueError(f"extend_rows needs at least 1 token in every row, got {widths}")
        keep = [1] * len(widths) if keep is None else list(keep)
        if len(keep) != len(widths) or any(not 1 <= n <= m for n, m in zip(keep, widths)):
            raise ValueError(f"keep must name 1 to a row's width of logits per row: widths {widths}, keep {keep}")
        closed = [b for b, c in enumerate(caches) if not c.open]
        if closed:
            raise ValueError(f"decode caches {closed} are closed: their slots were given back")
        full = [b for b, (c, m) in enumerate(zip(caches, widths)) if c.length + m > c.capacity]
        if full:
            b = full[0]
            raise ValueError(
                f"decode caches {full} are full ({caches[b].capacity} positions): no room for {widths[b]} more"
            )
        if len({id(c) for c in caches}) < len(caches):
            raise ValueError("extend_rows got one cache twice: a sequence is extended once a step")
        group = self.model.config.num_attention_heads // self.layout.n_kv_heads  # query heads per KV head
        classes: dict[tuple[int, int], list[int]] = {}  # rows by pool and width: one attention call a layer each
        for b, (c, m) in enumerate(zip(caches, widths)):
            classes.setdefault((id(c.pool), m), []).append(b)
        ends = list(accumulate(widths))
        at = [torch.arange(e - m, e, device=self.device) for e, m in zip(ends, widths)]  # per row: its tokens' rows
        parts = [
            (
                caches[rows[0]].pool,
                torch.cat([at[b] for b in rows]),  # [sum M]: the class's tokens, row-major
                RowStep.of(caches[rows[0]].pool, [caches[b] for b in rows], m, group),
            )
            for (_, m), rows in classes.items()
        ]
        order = torch.cat([picks for _, picks, _ in parts]).argsort()  # [sum M]: the tokens back in the callers' order
        positions = torch.cat(
            [torch.arange(c.length, c.length + m, device=self.device) for c, m in zip(caches, widths)]
        )  # [sum M]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [sum M, D]
        h = self.embed(torch.tensor([t for row in tokens for t in row], device=self.device))  # [sum M, E]
        for layer in range(self.layout.n_layers):
            q, k, v = self.qkv(layer, self.attention_input(layer, h), cos, sin)  # [H_q, sum M, D], [H_kv, sum M, D] x 2
            if len(parts) == 1:
                pool, _, step = parts[0]
                out = attend_rows(pool.keys[layer], pool.values[layer], step, q, k, v, self.scale)  # [sum M, H_q * D]
            else:
                out = torch.cat(
                    [
                        attend_rows(
                            pool.keys[layer],
                            pool.values[layer],
                            step,
                            q[:, picks],
                            k[:, picks],
                            v[:, picks],
                            self.scale,
                        )
                        for pool, picks, step in parts
                    ]
                )[order]  # [sum M, H_q * D]
            h = self.finish(layer, h, out)  # [sum M, E]
        for c, m in zip(caches, widths):
            c.length += m
        kept = [t for e, n in zip(ends, keep) for t in range(e - n, e)]  # the rows of h whose logits are returned
        return self.logits(h[torch.tensor(kept, device=self.device)])  # [sum keep, V]
