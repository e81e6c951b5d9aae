"""Model adapter for vLLM's own layers: the fusion methods run on the model a vLLM worker has loaded.

The per-layer pieces `selective_prefill` drives (`embed`, `attention_input`, `qkv`, `kv`, `q`, `finish`,
`logits`), computed by vLLM's modules of a Llama-shaped decoder (Llama, Mistral, Qwen2, Qwen3: each layer
an `input_layernorm`, a `self_attn` with `qkv_proj`, `o_proj` and `rotary_emb`, a `post_attention_layernorm`
and an `mlp`): vLLM's projections (its own weights, kernels and quantisation), norms and MLP. Attention over
the fused cache stays the engine's (`ops.causal_attend`), and RoPE is applied with the engine's tables made
from vLLM's own inverse frequencies, the ones its attention rotates the question with.

Nothing here imports vLLM: the adapter reads the module tree it is given. The vLLM connector
(`serving/vllm_connector.py`) finds the loaded model and hands it over. One rank only: with tensor or
pipeline parallelism a worker holds a slice of the heads or the layers, which the adapter refuses.
"""

from __future__ import annotations

import logging

import torch

from .ops import apply_rope
from .spec import ModelSpec, UnsupportedModelError

log = logging.getLogger(__name__)

LAYER_PARTS = (
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "self_attn.rotary_emb",
    "post_attention_layernorm",
    "mlp",
)


class VllmAdapter(ModelSpec):
    """A vLLM `*ForCausalLM` module with the per-layer hooks of `ModelAdapter` (the fusion engine's side of
    it); the tokenizer, the model's identity and its config come from `spec`, the index's model's (which must
    be the weights vLLM loaded), the dtype, device and RoPE tables from vLLM's modules."""

    computes = True

    def __init__(self, model: torch.nn.Module, spec: ModelSpec) -> None:
        self.model = model
        inner = model.model
        self.blocks = list(inner.layers)
        if len(self.blocks) != spec.layout.n_layers:
            raise UnsupportedModelError(
                f"vLLM's model has {len(self.blocks)} decoder layers, the index's "
                f"{spec.layout.n_layers}: serve the model the index was built with"
            )
        for part in LAYER_PARTS:
            try:
                self.blocks[0].get_submodule(part)
            except AttributeError as err:
                raise UnsupportedModelError(
                    f"vLLM's {type(self.blocks[0]).__name__} has no {part!r}: the adapter "
                    "runs Llama-shaped decoder layers only"
                ) from err
        attn = self.blocks[0].self_attn
        if attn.num_kv_heads != spec.layout.n_kv_heads or attn.head_dim != spec.layout.head_dim:
            raise UnsupportedModelError(
                f"this vLLM worker holds {attn.num_kv_heads} KV heads of {attn.head_dim}, the index's model "
                f"{spec.layout.n_kv_heads} of {spec.layout.head_dim}: tensor parallelism is not supported"
            )
        rope = attn.rotary_emb
        if not rope.is_neox_style or rope.rotary_dim != attn.head_dim:
            raise UnsupportedModelError(
                f"vLLM's rotary embedding rotates {rope.rotary_dim} of {attn.head_dim} dims "
                f"(neox style: {rope.is_neox_style}); the engine rotates whole heads, neox style"
            )
        weight = next(model.parameters())
        super().__init__(
            spec.model_config,
            spec.generation_config,
            spec.tokenizer,
            spec.name,
            spec.fingerprint,
            weight.dtype,
            weight.device,
            rope._compute_inv_freq(rope.base).to(torch.float32),  # [D/2], vLLM's own
            attn.scaling,
        )
        if weight.dtype != spec.dtype:
            log.warning(
                "vLLM runs %s in %s, the index's caches are %s: caches this worker makes (misses) are computed in %s",
                spec.name,
                weight.dtype,
                spec.dtype,
                weight.dtype,
            )
        self.sizes = [attn.q_size, attn.kv_size, attn.kv_size]  # q's, k's and v's columns of qkv_proj's output

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)  # [T, E]

    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[layer].input_layernorm(h)  # [T, E]

    def _project(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H_q, D], k [T, H_kv, D] and v [T, H_kv, D] before RoPE, from vLLM's fused projection (and
        Qwen3's per-head norms)."""
        attn = self.blocks[layer].self_attn
        y, _ = attn.qkv_proj(x)  # [T, (H_q + 2 H_kv) * D]
        q, k, v = (t.view(x.shape[0], -1, self.layout.head_dim) for t in y.split(self.sizes, dim=-1))  # [T, H, D] x 3
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head of q and k before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)  # [T, H_q, D], [T, H_kv, D]
        return q, k, v

    def qkv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._project(layer, x)
        h_q = q.shape[1]
        qk = apply_rope(torch.cat([q, k], dim=1).transpose(0, 1), cos, sin)  # [H_q + H_kv, T, D]
        return qk[:h_q], qk[h_q:], v.transpose(0, 1)  # [H_q, T, D], [H_kv, T, D], [H_kv, T, D]

    def kv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v of the tokens of x; vLLM's projection is fused, so q's columns are computed and dropped."""
        _, k, v = self._project(layer, x)
        return apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)  # [H_kv, T, D] x 2

    def q(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self._project(layer, x)[0].transpose(0, 1), cos, sin)  # [H_q, T, D]

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP of one layer, [T, E] -> [T, E], by vLLM's modules (not its
        fused add-and-norm, which writes into its inputs)."""
        block = self.blocks[layer]
        o, _ = block.self_attn.o_proj(attn_out)  # [T, E]
        h = h + o  # [T, E]
        return h + block.mlp(block.post_attention_layernorm(h))  # [T, E]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model.model.norm(h)).float()  # [T, V]
