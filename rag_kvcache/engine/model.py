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
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    DynamicCache,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
)

from ..config import Config
from ..errors import RagKVCacheError
from .decoding import DecodeCache, RowStep, attend_rows
from .graphs import LayerGraphs
from .interface import KVLayout
from .ops import apply_rope, attend, attention_plan, causal_attend, rope_cos_sin
from .sentences import Lexicon
from .sources import resolve_model_source

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
EXACT_ROPE_TYPES = ("default", "linear", "llama3")  # scaling lives in inv_freq alone
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModelError(RagKVCacheError, ValueError):
    """The model cannot have its chunk caches fused exactly."""


def _fuse_rows(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of outputs, in] (and bias) for projections that read the same input, the modules'
    own weights (and biases) made views into it: one matmul computes them all and the weights are held once."""
    weight = torch.cat([m.weight.detach() for m in linears])  # [O, E]
    biased = all(m.bias is not None for m in linears)
    bias = torch.cat([m.bias.detach() for m in linears]) if biased else None  # [O]
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight.data = weight[start:end]  # [O_i, E], a view
        if bias is not None:
            m.bias.data = bias[start:end]  # [O_i], a view
        start = end
    return weight, bias


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the per-layer pieces read them: projections that share an input fused
    (q, k, v; gate, up) and every weight transposed once ([in, out] views), so a projection is one `mm`."""

    input_norm: torch.Tensor  # [E]
    post_norm: torch.Tensor  # [E]
    eps: float  # both norms' (the config's rms_norm_eps)
    qkv: torch.Tensor  # [E, (H_q + 2 H_kv) * D], the q, k, v projections' weights in one, transposed
    qkv_bias: torch.Tensor | None  # [(H_q + 2 H_kv) * D]
    n_q: int  # H_q * D: q's columns of `qkv`, then k's and v's
    o: torch.Tensor  # [H_q * D, E]
    o_bias: torch.Tensor | None  # [E]
    gate_up: torch.Tensor  # [E, 2 I], gate's columns then up's
    gate_up_bias: torch.Tensor | None  # [2 I]
    down: torch.Tensor  # [I, E]
    down_bias: torch.Tensor | None  # [E]
    q_norm: torch.nn.Module | None  # Qwen3 normalises each head of q and k before RoPE
    k_norm: torch.nn.Module | None

    @classmethod
    def of(cls, block: torch.nn.Module) -> LayerWeights:
        """Fuse one decoder layer's projections (`_fuse_rows`: the modules keep views, no weight is held twice)."""
        attn, mlp = block.self_attn, block.mlp
        qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])  # [(H_q + 2 H_kv) * D, E]
        gate_up, gate_up_bias = _fuse_rows([mlp.gate_proj, mlp.up_proj])  # [2 I, E]
        return cls(
            block.input_layernorm.weight.detach(),
            block.post_attention_layernorm.weight.detach(),
            block.input_layernorm.variance_epsilon,
            qkv.t(),
            qkv_bias,
            attn.q_proj.out_features,
            attn.o_proj.weight.detach().t(),
            None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            gate_up.t(),
            gate_up_bias,
            mlp.down_proj.weight.detach().t(),
            None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
            getattr(attn, "q_norm", None),
            getattr(attn, "k_norm", None),
        )


NARROW_ROWS = 4  # a product over at most this many rows (a decoding step's) may take `narrow_product`'s form


def narrow_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] times a transposed weight [in, out], computed as the weight's own [out, in] layout times x's M
    columns and transposed back, one row fed as two (its copy's column dropped): a BLAS may take a faster kernel
    for a matrix times a few columns than for a few rows times a transposed matrix or a matrix-vector product
    (MKL on an AMD Zen 4; `narrow_is_faster` times both at load). Equal to `x @ weight` to float rounding."""
    cols = (x if x.shape[0] > 1 else torch.cat([x, x])).t()  # [in, max(M, 2)]
    return torch.mm(weight.t(), cols)[:, : x.shape[0]].t().contiguous()  # [M, out]


def prefer_narrow(wide_s: float, narrow_s: float) -> bool:
    """Whether a product timed at `narrow_s` with `narrow_product` and `wide_s` with `torch.mm` should take the
    narrow form: a quarter faster and 1 ms a product, so a model too small for it to matter keeps `torch.mm`
    whatever the timer's noise (the same kernels, run after run)."""
    return narrow_s <= 0.75 * wide_s and wide_s - narrow_s >= 1e-3


def narrow_is_faster(weight: torch.Tensor, repeats: int = 3) -> bool:
    """Whether `narrow_product` beats `torch.mm` on this machine for `weight` [in, out] at 1 and 3 rows (a
    decoding step, a step verifying two drafted tokens), by `prefer_narrow`, each timed as the best of
    `repeats` calls after one."""
    for rows in (1, 3):
        x = torch.randn(rows, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)  # [M, in]
        wide, narrow = (
            _best_time(lambda: torch.mm(x, weight), repeats),
            _best_time(lambda: narrow_product(x, weight), repeats),
        )
        if not prefer_narrow(wide, narrow):
            return False
    return True


def _best_time(call: Callable[[], object], repeats: int) -> float:
    """The shortest of `repeats` timed calls of `call`, after one untimed."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def check_supported(model: PreTrainedModel) -> None:
    """Refuse, with the reason, any model whose chunk caches cannot be re-rotated and fused exactly."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in EXACT_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} scales cos/sin or depends on sequence length, so cached keys cannot be "
            f"re-rotated exactly; supported: {', '.join(EXACT_ROPE_TYPES)}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial rotary (factor {rope['partial_rotary_factor']}) is not supported")
    if getattr(cfg, "use_sliding_window", False) or any(
        t == "sliding_attention" for t in (getattr(cfg, "layer_types", None) or ())
    ):
        raise UnsupportedModelError("sliding-window attention layers are not supported")


def weights_fingerprint(
    model_config: PretrainedConfig, dtype: torch.dtype, tensors: Iterable[tuple[str, torch.Tensor]]
) -> str:
    """Identity of the weights, architecture and dtype: part of every cache key. `tensors`: (name, weight in
    `dtype`) in the order of the model's `named_parameters()`. The config's `transformers_version` (the release
    that wrote it) is left out: it changes no K/V, and with it every cache missed after a transformers upgrade,
    or between .venv and .venv-vllm (5.24 and 5.19)."""
    h = xxhash.xxh3_128()
    config = {k: v for k, v in model_config.to_diff_dict().items() if k != "transformers_version"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    with torch.no_grad():
        for name, p in tensors:
            h.update(name.encode())
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def checkpoint_tensors(folder: Path, names: Sequence[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `names` of the checkpoint in `folder` (its safetensors files), each cast to `dtype` as
    `from_pretrained` casts it, read one at a time."""
    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            where.update(dict.fromkeys(f.keys(), path))
    if missing := [n for n in names if n not in where]:
        raise UnsupportedModelError(
            f"checkpoint {folder} has no safetensors tensor {missing[0]!r} ({len(missing)} of {len(names)} missing)"
        )
    for name in names:
        with safe_open(where[name], "pt") as f:
            yield name, f.get_tensor(name).to(dtype)


class ModelSpec:
    """A causal LM's identity and shape without its weights: tokenizer, fingerprint, KV layout, RoPE tables,
    and the packed prefill over per-layer pieces (`embed`, `attention_input`, `qkv`, `finish`) that a subclass
    computes: `ModelAdapter` on transformers' weights, `vllm_model.VllmAdapter` on a vLLM worker's. A bare
    spec (`ModelSpec.load`) lays prompts out over an index and computes nothing: the vLLM connector's
    scheduler holds one, so that no process keeps a copy of the weights it does not run."""

    graphs: LayerGraphs | None = None  # the settled layers as one captured step (None: op by op)
    computes = False  # whether it has weights to run the per-layer pieces on (a subclass's)

    def __init__(
        self,
        model_config: PretrainedConfig,
        generation_config: GenerationConfig,
        tokenizer,
        name: str,
        fingerprint: str,
        dtype: torch.dtype,
        device: torch.device,
        inv_freq: torch.Tensor,
        scale: float,
    ) -> None:
        """`inv_freq` [D/2] float32: the model's RoPE frequencies; `scale`: its attention's softmax scale."""
        self.model_config = model_config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.device = device
        self.inv_freq = inv_freq  # [D/2]
        self.scale = scale
        cfg = model_config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, self.head_dim, dtype)
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self.n_q_heads = cfg.num_attention_heads

    @classmethod
    def load(cls, config: Config) -> ModelSpec:
        """The spec of `config.index.model` in `config.index.dtype`, read from its checkpoint without keeping a
        weight: the architecture built on the meta device, the fingerprint streamed from the safetensors files
        one tensor at a time (`checkpoint_tensors`), equal to the fingerprint of the loaded model."""
        source = resolve_model_source(config.index.model, config.runtime.cache_dir)
        folder = Path(source) if isinstance(source, Path) else Path(snapshot_download(source))
        model_config = AutoConfig.from_pretrained(folder)
        dtype = DTYPES[config.index.dtype]
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation="sdpa")
        check_supported(skeleton)
        try:
            generation = GenerationConfig.from_pretrained(folder)
        except OSError:  # no generation_config.json: what from_pretrained derives from the model's config
            generation = GenerationConfig.from_model_config(skeleton.config)
        names = [name for name, _ in skeleton.named_parameters()]
        return cls(
            skeleton.config,
            generation,
            AutoTokenizer.from_pretrained(folder),
            config.index.model,
            weights_fingerprint(skeleton.config, dtype, checkpoint_tensors(folder, names, dtype)),
            dtype,
            torch.device("cpu"),
            type(skeleton.model.rotary_emb)(config=skeleton.config).inv_freq.to(torch.float32),  # [D/2]
            skeleton.model.layers[0].self_attn.scaling,
        )

    @cached_property
    def lexicon(self) -> Lexicon:
        """The tokenizer's word classes (sentence ends, words), made on first use (one decode of the vocabulary)."""
        return Lexicon.of(self.tokenizer, self.device)

    @property
    def context_length(self) -> int:
        """The most positions the model was trained for (prompt and generated tokens together)."""
        return self.model_config.max_position_embeddings

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- per-layer pieces: a subclass's, on its weights ------------------------------------------------
    def _no_weights(self) -> RagKVCacheError:
        return RagKVCacheError(f"model {self.name!r} is a spec without weights here: it computes no layer")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise self._no_weights()

    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        raise self._no_weights()

    def qkv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise self._no_weights()

    def kv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_weights()

    def q(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        raise self._no_weights()

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        raise self._no_weights()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        raise self._no_weights()

    # ---- the indexing prefill, on a subclass's layers ---------------------------------------------------
    @torch.inference_mode()
    def prefill_packed(
        self, chunks: Sequence[Sequence[int]], past: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Each chunk's keys and values per layer [H_kv, T_i, D], every chunk computed behind the same
        `past` (per-layer K/V [H_kv, P, D]) at positions P..P+T_i-1, in one forward over all the chunks'
        tokens packed end to end: embedding, projections and MLPs run once on the packed [N, E] rows;
        each chunk attends (causally) over the past and its own tokens alone, so nothing of one chunk
        reaches another and none is padded. A chunk's K/V are the same, to float rounding, whichever chunks
        share its pack (rows of a matmul are computed independently; a BLAS may block them by the row count).
        The last layer's attention output and MLP, which no K/V depends on, are not computed."""
        if not chunks or not all(chunks):
            raise ValueError(f"prefill_packed needs non-empty chunks, got lengths {[len(c) for c in chunks]}")
        p = 0 if past is None else past[0][0].shape[-2]
        lengths = [len(c) for c in chunks]
        ends = list(accumulate(lengths))
        spans = list(zip([0, *ends[:-1]], ends))
        positions = torch.cat([torch.arange(p, p + n) for n in lengths]).to(self.device)  # [N]
        cos, sin = rope_cos_sin(positions, self.inv_freq.to(self.device), self.dtype)  # [N, D]
        h = self.embed(torch.tensor([t for c in chunks for t in c], device=self.device))  # [N, E]
        group = self.n_q_heads // self.layout.n_kv_heads
        plans = (
            {}
            if past is None
            else {  # behind a past, a chunk of n tokens at P..P+n-1: on a CPU one causal pass over its own keys (half
                # the scores of a masked [n, P + n] call, for a grouped index's sequences of thousands) merged
                # with an unmasked one over the past's; on CUDA one masked call
                n: attention_plan(torch.arange(p, p + n, device=self.device), p + n, group, self.dtype)
                for n in set(lengths)
            }
        )
        out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in spans]
        for layer in range(self.layout.n_layers):
            q, k, v = self.qkv(
                layer, self.attention_input(layer, h), cos, sin
            )  # [H_q, N, D], [H_kv, N, D], [H_kv, N, D]
            for (keys, values), (s, e) in zip(out, spans):  # own copies: k and v are views of the layer's projection
                keys.append(k[:, s:e].contiguous())  # [H_kv, T_i, D]
                values.append(v[:, s:e].contiguous())  # [H_kv, T_i, D]
            if layer == self.layout.n_layers - 1:
                break
            parts = []
            for (keys, values), (s, e) in zip(out, spans):
                k_i, v_i = keys[-1], values[-1]  # [H_kv, T_i, D]
                if past is not None:
                    k_i = torch.cat([past[0][layer], k_i], 1)  # [H_kv, P + T_i, D]
                    v_i = torch.cat([past[1][layer], v_i], 1)  # [H_kv, P + T_i, D]
                parts.append(
                    attend(q[:, s:e], k_i, v_i, None, self.scale)
                    if past is None
                    else causal_attend(q[:, s:e], k_i, v_i, plans[e - s], self.scale)
                )  # [T_i, H_q * D]
            h = self.finish(layer, h, torch.cat(parts))  # [N, E]
        return out


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
