"""A decoder layer's tensors as the per-layer pieces read them (`LayerWeights`: projections that share an input
fused, weights transposed once), and the narrow products a decoding step's few rows take where this machine
computes them faster (`narrow_product`, chosen at load by `narrow_is_faster`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


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
