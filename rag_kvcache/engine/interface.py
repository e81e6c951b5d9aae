"""What the fusion runs on, below the engine that runs it: a model's K/V shape (`KVLayout`), its per-layer
pieces (`FusionModel`, which each model adapter implements), and what a captured step of settled layers
takes (`StepInput`, CacheBlend's `Pick`) and does (`CapturedLayers`, which `graphs.LayerGraphs` implements)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .sentences import Lexicon


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV across the model."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Pick:
    """CacheBlend's selection at `layer`, its count known before the forward: after the layer's K/V projection,
    the `keep` active tokens whose fresh K (or V) deviates most from their cache go on through its attention
    and every later layer (the uncached ones first)."""

    layer: int
    keep: int


@dataclass(frozen=True)
class StepInput:
    """Where a captured step takes over a fused prefill: its first layer, the active tokens' prompt positions
    (ascending, the last prompt token last), their hidden states and RoPE tables, and the prompt's length.
    With `picks` (the step starts at layer 0) the active set is narrowed at each pick's layer (`Pick`),
    by the deviation of K (`which` 0) or V (1), every `forced` token [A] kept: CacheBlend's whole forward
    as one step. Without, the active set is settled: the same in every layer from `start`."""

    start: int
    h: torch.Tensor  # [A, E]
    active: torch.Tensor  # [A]
    cos: torch.Tensor  # [A, D]
    sin: torch.Tensor  # [A, D]
    n: int
    picks: tuple[Pick, ...] = ()
    forced: torch.Tensor | None = None  # [A] bool, with picks
    which: int = 0


class CapturedLayers(Protocol):
    """The settled layers, and the model's head after them, as one step over static buffers
    (`graphs.LayerGraphs`)."""

    def run(self, at: StepInput, fill: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last prompt token's logits [V] and the step's layers' K/V [L', 2, H_kv, N, D], `fill`
        writing the cached layers into the step's buffer first."""
        ...


class FusionModel(Protocol):
    """What the fusion methods run on: a model's per-layer pieces. `model.ModelAdapter` (transformers) and
    `vllm_model.VllmAdapter` (vLLM's loaded layers) are the two."""

    layout: KVLayout
    device: torch.device
    dtype: torch.dtype
    inv_freq: torch.Tensor  # [D/2], float32
    scale: float
    sliding_window: int | None
    n_q_heads: int

    @property
    def graphs(self) -> CapturedLayers | None: ...  # the settled layers as one captured step (None: op by op)

    @property
    def lexicon(self) -> Lexicon: ...
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, E]
    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor: ...  # [T, E] -> [T, E]
    def qkv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # [H_q, T, D], [H_kv, T, D] x 2
    def kv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # [H_kv, T, D] x 2
    def q(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...  # [H_q, T, D]
    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor: ...  # [T, E]
    def logits(self, h: torch.Tensor) -> torch.Tensor: ...  # [T, E] -> [T, V]
