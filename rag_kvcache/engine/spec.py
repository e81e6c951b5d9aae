"""`ModelSpec`: a causal LM's identity and shape without its weights (tokenizer, KV layout, RoPE tables, the
fingerprint every cache key carries, read from the checkpoint), what cannot be fused exactly refused
(`check_supported`, `UnsupportedModelError`), and the packed prefill over the per-layer pieces a subclass computes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from itertools import accumulate
from pathlib import Path

import torch
import xxhash
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from ..config import Config
from ..errors import RagKVCacheError
from .graphs import LayerGraphs
from .interface import KVLayout
from .ops import attend, attention_plan, causal_attend, rope_cos_sin
from .sentences import Lexicon
from .sources import resolve_model_source

log = logging.getLogger(__name__)

Pause = Callable[[], None]  # called before each layer of a forward: background work is stopped there


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
EXACT_ROPE_TYPES = ("default", "linear", "llama3")  # scaling lives in inv_freq alone
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModelError(RagKVCacheError, ValueError):
    """The model cannot have its chunk caches fused exactly."""


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
        self,
        chunks: Sequence[Sequence[int]],
        past: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        pause: Pause | None = None,
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Each chunk's keys and values per layer [H_kv, T_i, D], every chunk computed behind the same
        `past` (per-layer K/V [H_kv, P, D]) at positions P..P+T_i-1, in one forward over all the chunks'
        tokens packed end to end: embedding, projections and MLPs run once on the packed [N, E] rows;
        each chunk attends (causally) over the past and its own tokens alone, so nothing of one chunk
        reaches another and none is padded. A chunk's K/V are the same, to float rounding, whichever chunks
        share its pack (rows of a matmul are computed independently; a BLAS may block them by the row count).
        The last layer's attention output and MLP, which no K/V depends on, are not computed. `pause`, if given, is
        called before each layer: background work (a server's cache making) waits there while requests run."""
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
            if pause is not None:
                pause()
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
