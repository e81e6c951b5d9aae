"""The fused prefill's layers as one captured step (`LayerStep`): a CUDA graph per bucket of sizes.

Once a prompt's active set stops changing (from the first layer for `prefix`, `reuse` and the EPIC
methods; after its last pick for CacheBlend), every remaining layer does the same thing:
project the active tokens, write their K/V into the layer's buffer, attend with the exact causal mask,
run the MLP. Issued op by op, that is ~200 PyTorch calls a layer whose host time is most of the step on
a GPU (benchmarks/RESULTS.md, issue 30). `LayerGraphs` runs those layers, and the model's head after them,
over fixed-size buffers instead, so that on CUDA they are captured once per bucket and replayed: one launch for
all of them. Few active tokens over many keys would leave most of a GPU idle in the attention kernel, so the
step cuts the keys into parts attended side by side (`key_splits`, `ops.attend_split`).

CacheBlend's selection joins the step (`Pick`): the number of tokens it keeps at its check layer is known
from the prompt's layout before the forward, so its first layers, its pick (a top-k on the device whose
count is an input) and the narrowed layers after it are one step from the embedding on, with no host work
between layers.

A bucket is (first layer, active tokens rounded up, prompt tokens rounded up, the picks' layers and rows
rounded up). Padding is laid
out so it changes no real value: padded query rows come first (the real last token stays the last row,
which the last layer narrows to), start from a zero hidden state, write their K/V into a scratch key
column past the prompt that no query reads, and attend every key; real rows attend keys up to their own
position only, so the padded keys past the prompt get zero weight; a pick never picks a padded row and
lays the rows it does not keep out as padding. Off CUDA (`capture=False`) the same
padded step runs eagerly: the tests check it against the same layers op by op on a CPU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from .interface import FusionModel, StepInput
from .ops import (
    AttentionPlan,
    QueryRun,
    causal_attend,
    causal_mask_for,
    kv_deviation,
    mask_bias,
    pick_rows,
)
from .profiling import StageClock


def settled_layers(
    adapter: FusionModel,
    layers: range,
    h: torch.Tensor,
    active: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_kv: Callable[[int], torch.Tensor],
    plan: AttentionPlan,
    last_plan: AttentionPlan,
    clock: StageClock,
) -> torch.Tensor:
    """The fused prefill's layers `layers` (up to the model's last) for a fixed active set `active` [A] (the
    prompt's last token last) with hidden states h [A, E] and RoPE tables cos/sin [A, D]: each layer's q, k,
    v in one projection, the active tokens' K/V written into `layer_kv(layer)` [2, H_kv, K, D], attention
    under `plan` (the last layer: the last token alone, under `last_plan`), the MLP. Returns the last
    token's hidden state [1, E]. Run op by op by `fusion.selective_prefill`, and over static buffers by
    `LayerStep` (captured on CUDA)."""
    last = adapter.layout.n_layers - 1
    for layer in layers:
        keys, values = layer_kv(layer).unbind(0)  # [H_kv, K, D]
        with clock.stage("qkv"):
            x = adapter.attention_input(layer, h)  # [A, E]
            if layer < last:
                q, k, v = adapter.qkv(layer, x, cos, sin)  # [H_q, A, D], [H_kv, A, D] x 2
            else:
                k, v = adapter.kv(layer, x, cos, sin)  # [H_kv, A, D] x 2
            keys.index_copy_(1, active, k)
            values.index_copy_(1, active, v)
            if layer == last:  # only the last token's output is read, by the logits
                h, x, plan = h[-1:], x[-1:], last_plan  # [1, E], [1, E]
                q = adapter.q(layer, x, cos[-1:], sin[-1:])  # [H_q, 1, D]
        with clock.stage("attention"):
            attn = causal_attend(q, keys, values, plan, adapter.scale)  # [A, H_q * D]
        with clock.stage("mlp"):
            h = adapter.finish(layer, h, attn)  # [A, E]
    return h


def bucket(n: int, floor: int, step: int) -> int:
    """`n` rounded up: to a power of two from `floor` up to `step`, beyond it to a multiple of `step`."""
    if n <= step:
        return max(floor, 1 << (n - 1).bit_length())
    return -(-n // step) * step


def key_splits(rows: int, kv_heads: int, n_keys: int, processors: int) -> int:
    """How many equal parts to cut `n_keys` keys into for `rows` query rows a KV head (`ops.attend_split`),
    so that the attention kernel's thread blocks (one per KV head and tile of 64 query rows: the
    memory-efficient kernel's) number at least `processors`: powers of two, parts of at least 64 keys and
    a multiple of 16 (the kernel's bias alignment). 0 processors: one part."""
    blocks, splits = kv_heads * -(-rows // 64), 1
    while blocks * splits < processors and n_keys % (32 * splits) == 0 and n_keys // (2 * splits) >= 64:
        splits *= 2
    return splits


class LayerStep:
    """Layers [start, L) of the fused prefill for at most `n_active` active tokens of a prompt of at most
    `n_keys` tokens, over static buffers; with `capture`, recorded once as a CUDA graph and replayed. The
    attention's keys are cut into parts to give at least `processors` thread blocks (`key_splits`).
    `picks` ((layer, rows) each, `StepInput.picks`): the active set narrowed at those layers to at most that many
    rows (the count kept is an input: `keep`), by the deviation of K (`which` 0) or V (1)."""

    def __init__(
        self,
        adapter: FusionModel,
        start: int,
        n_active: int,
        n_keys: int,
        width: int,
        capture: bool,
        processors: int,
        picks: tuple[tuple[int, int], ...] = (),
        which: int = 0,
    ) -> None:
        layout = adapter.layout
        group = adapter.n_q_heads // layout.n_kv_heads
        self.adapter, self.start, self.picks, self.which = adapter, start, picks, which
        dev, dt = adapter.device, adapter.dtype
        self.h = torch.zeros(n_active, width, dtype=dt, device=dev)  # [A, E]
        self.active = torch.full((n_active,), n_keys, dtype=torch.long, device=dev)  # [A]
        self.cos = torch.zeros(n_active, layout.head_dim, dtype=dt, device=dev)  # [A, D]
        self.sin = torch.zeros_like(self.cos)  # [A, D]
        self.forced = torch.zeros(n_active, dtype=torch.bool, device=dev)  # [A]
        self.keep = torch.zeros(len(picks), dtype=torch.long, device=dev)  # [P], the count each pick keeps
        self.keys = torch.arange(n_keys, device=dev)  # [K]
        # every layer's K/V from `start`, and one scratch column (index K) for the padded rows' writes
        self.kv = torch.zeros(
            layout.n_layers - start, 2, layout.n_kv_heads, n_keys + 1, layout.head_dim, dtype=dt, device=dev
        )  # [L', 2, H_kv, K + 1, D]
        self.plans = []  # the attention plan of each run of layers between picks (`aim` points it at its rows)
        for i, rows in enumerate((n_active, *(size for _, size in picks))):
            if 2 * rows >= n_keys:  # most positions are queries: one causal pass over every position, bias-free
                at = self.active if i == 0 else torch.zeros(rows, dtype=torch.long, device=dev)  # [rows]
                self.plans.append(AttentionPlan(at, n_keys + 1, ()))  # the scratch column is a position too
                continue
            bias = torch.zeros(group * rows, n_keys, dtype=dt, device=dev)  # [G * rows, K]
            run = QueryRun(0, rows, 0, bias, key_splits(group * rows, layout.n_kv_heads, n_keys, processors))
            self.plans.append(AttentionPlan(self.active[:rows], n_keys, (run,)))
        self.last_bias = torch.zeros(group, n_keys, dtype=dt, device=dev)  # [G, K]
        last_splits = key_splits(group, layout.n_kv_heads, n_keys, processors)
        self.last_plan = AttentionPlan(self.active[-1:], n_keys, (QueryRun(0, 1, 0, self.last_bias, last_splits),))
        self.captured: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # graph, its logits
        if capture:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # allocations and lazy kernel set-up before recording
                self.layers()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.layers()  # [1, V], in the graph's memory
            self.captured = graph, out

    def layers(self) -> torch.Tensor:
        """`settled_layers` over the static buffers between the picks (each run's attention bias made from its
        active positions: padded rows see every key), then the model's head: the last token's logits [1, V]."""
        adapter, start = self.adapter, self.start
        h, active, cos, sin, forced = self.h, self.active, self.cos, self.sin, self.forced
        at = start
        for i, plan in enumerate(self.plans):
            self.aim(plan, active)
            end = self.picks[i][0] if i < len(self.picks) else adapter.layout.n_layers
            if end == adapter.layout.n_layers:
                self.aim(self.last_plan, active[-1:])
            h = settled_layers(
                adapter,
                range(at, end),
                h,
                active,
                cos,
                sin,
                lambda layer: self.kv[layer - start],
                plan,
                self.last_plan,
                StageClock(),
            )  # [A, E]; [1, E] after the last layer
            if end == adapter.layout.n_layers:
                break
            h, active, cos, sin, forced = self.pick(i, h, active, cos, sin, forced)
            at = end + 1
        return adapter.logits(h)  # [1, V]

    def aim(self, plan: AttentionPlan, active: torch.Tensor) -> None:
        """Point `plan` at the rows at prompt positions `active` [A]: its bias rows (padded rows see every key),
        or for a plan over every position (no runs) its positions."""
        if not plan.runs:
            if plan.positions is not active:
                plan.positions.copy_(active)  # [A]
            return
        rows = mask_bias(causal_mask_for(active, self.keys), plan.runs[0].bias.dtype)  # [A, K]
        plan.runs[0].bias.view(-1, *rows.shape).copy_(rows)  # [G, A, K]

    def pick(
        self, i: int, h: torch.Tensor, active: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forced: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Pick `i`'s layer: the K/V of every active row, the rows that go on picked by their deviation from the
        cache (`ops.pick_rows`), then Q, attention and MLP for those. Returns their h, positions, cos, sin and
        forced flags."""
        adapter, scratch = self.adapter, self.keys.numel()
        layer, size = self.picks[i]
        keys, values = self.kv[layer - self.start].unbind(0)  # [H_kv, K + 1, D]
        x = adapter.attention_input(layer, h)  # [A, E]
        k, v = adapter.kv(layer, x, cos, sin)  # [H_kv, A, D] x 2
        cached = (keys, values)[self.which][:, active]  # [H_kv, A, D]
        scores = kv_deviation((k, v)[self.which], cached)  # [A]
        keys.index_copy_(1, active, k)  # every computed row's fresh K/V, picked or not
        values.index_copy_(1, active, v)
        real = active != scratch  # [A]
        picked, kept = pick_rows(scores, forced, real, self.keep[i], size)  # [S] x 2
        on = kept[:, None]  # [S, 1]
        h, x, cos, sin = (torch.where(on, t[picked], 0.0) for t in (h, x, cos, sin))  # [S, E] x 2, [S, D] x 2
        active = torch.where(kept, active[picked], scratch)  # [S]
        forced = forced[picked] & kept  # [S]
        plan = self.plans[i + 1]
        self.aim(plan, active)
        q = adapter.q(layer, x, cos, sin)  # [H_q, S, D]
        attn = causal_attend(q, keys, values, plan, adapter.scale)  # [S, H_q * D]
        return adapter.finish(layer, h, attn), active, cos, sin, forced

    def __call__(self, at: StepInput, fill: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layers from `at` (its active set padded to this step's size); `fill` writes the layers' cached
        K/V into the [L', 2, H_kv, n, D] it is given (`LayerReader.fill`). Returns the last token's next-token
        logits [V] and every layer's K/V from `start` with the computed tokens' written, [L', 2, H_kv, n, D]
        (new memory)."""
        n, pad = at.n, self.active.numel() - at.active.numel()
        self.h[pad:].copy_(at.h)
        self.h[:pad].zero_()
        self.active[:pad].fill_(self.keys.numel())  # the scratch column
        self.active[pad:].copy_(at.active)
        self.cos[pad:].copy_(at.cos)
        self.sin[pad:].copy_(at.sin)
        if at.forced is not None:
            self.forced[:pad].fill_(False)
            self.forced[pad:].copy_(at.forced)
            for i, p in enumerate(at.picks):
                self.keep[i].fill_(p.keep)
        fill(self.kv[:, :, :, :n])  # [L', 2, H_kv, n, D]
        if self.captured is None:
            out = self.layers()  # [1, V]
        else:
            graph, out = self.captured
            graph.replay()
            out = out.clone()  # [1, V]
        return out[0], self.kv[:, :, :, :n].clone()  # [V], [L', 2, H_kv, n, D]


class LayerGraphs:
    """A model's `LayerStep`s by bucket, at most `limit` kept (the least recently used dropped): each holds
    its settled layers' K/V buffers for its largest prompt.
    `capture` (default: on CUDA) records each as a CUDA graph the first time its bucket is asked for. Steps
    are shared by the model's fusions: one runs at a time (its inputs in, its outputs copied out).
    `processors`: the thread blocks each attention call should give the device (`key_splits`; default: the
    CUDA device's multiprocessors, elsewhere 0, keys in one part)."""

    def __init__(
        self, adapter: FusionModel, limit: int, capture: bool | None = None, processors: int | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"LayerGraphs keeps at least one step, got limit={limit!r}")
        self.adapter, self.limit = adapter, limit
        cuda = adapter.device.type == "cuda"
        self.capture = cuda if capture is None else capture
        if processors is None:
            processors = torch.cuda.get_device_properties(adapter.device).multi_processor_count if cuda else 0
        self.processors = processors
        self._steps: OrderedDict[tuple, LayerStep] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._steps)

    def run(self, at: StepInput, fill: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """`LayerStep.__call__` in the step of `at`'s bucket (made, and on CUDA captured, the first time the
        bucket is asked for). With picks, the rows before the first pick (most of the prompt, through whole
        layers) are rounded up to a multiple of 256, not to a power of two, and each pick's rows to no more
        than the rows before it."""
        rows = bucket(at.active.numel(), 16, 256 if at.picks else 1024)
        picks: list[tuple[int, int]] = []
        for p in at.picks:
            picks.append((p.layer, min(bucket(p.keep, 16, 256), picks[-1][1] if picks else rows)))
        key = (at.start, rows, bucket(at.n, 256, 256), at.h.shape[1], tuple(picks), at.which)
        with self._lock:
            step = self._steps.get(key)
            if step is None:
                while len(self._steps) >= self.limit:
                    self._steps.popitem(last=False)
                step = LayerStep(self.adapter, *key[:4], self.capture, self.processors, picks=key[4], which=key[5])
                self._steps[key] = step
            self._steps.move_to_end(key)
            return step(at, fill)
