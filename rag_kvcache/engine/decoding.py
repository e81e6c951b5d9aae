"""The K/V of sequences being decoded together, laid out so one attention call serves them all.

A `DecodePool` holds, per layer, one buffer [S, H_kv, C, D]: slot s is one sequence's cache, its
prompt's positions copied in when it is admitted and each decoded token's K/V written in place after
them. `ModelAdapter.extend_rows` (and `decode_rows`, one token a row) steps B of its sequences with,
per layer, one write of the new tokens' K/V and one attention call over the slots, each row masked
to its own positions (`RowStep`), less those it hides (`admit`'s `hidden`: an attention mask over part
of its prompt, for every token computed in that row after it). Slots are taken by `admit` and given back by
`DecodeCache.close` (the lowest free slot is taken next); the buffers grow when a sequence needs more
slots or positions than they have (contents copied) and are let go when the last slot is given back.

Memory: every slot has the longest admitted sequence's capacity, so a pool over rows of very
different lengths holds more than their caches would alone; a row's logits do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class DecodeCache:
    """One sequence's slot in a `DecodePool`: `length` positions are filled, the next token goes at
    `length`, at most `capacity`. `keys`/`values` are views of the pool's buffers, per layer
    [H_kv, C, D] (positions from `length` on are not the sequence's). `hidden`: bool [N] over the
    prompt's positions, those no token fed to this row attends to (None: none)."""

    def __init__(
        self, pool: DecodePool, slot: int, length: int, capacity: int, hidden: torch.Tensor | None = None
    ) -> None:
        self.pool, self.slot, self.length, self.capacity, self.hidden = pool, slot, length, capacity, hidden

    @property
    def open(self) -> bool:
        return self.slot < len(self.pool.rows) and self.pool.rows[self.slot] is self

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[self.slot] for k in self.pool.keys]  # L x [H_kv, C, D]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[self.slot] for v in self.pool.values]  # L x [H_kv, C, D]

    def close(self) -> None:
        """Give the slot back (its K/V may be overwritten by the next sequence admitted); idempotent."""
        if self.open:
            self.pool.release(self.slot)


class DecodePool:
    """Slots for the K/V of sequences decoded together (see the module)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # L x [S, H_kv, C, D]
        self.values: list[torch.Tensor] = []  # L x [S, H_kv, C, D]
        self.rows: list[DecodeCache | None] = []  # slot -> its sequence; trailing free slots trimmed

    @property
    def size(self) -> int:
        """Sequences holding a slot."""
        return sum(r is not None for r in self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (every slot, free or not, at the pool's capacity)."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    def admit(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        room: int,
        hidden: torch.Tensor | None = None,
    ) -> DecodeCache:
        """A slot holding the prompt's per-layer K/V [H_kv, N, D] (or [1, H_kv, N, D]), with `room`
        positions to decode into. `hidden` (bool [N]): prompt positions the tokens fed to this row never
        attend to, as if an attention mask covered them; the positions after them keep their places."""
        if room < 1:
            raise ValueError(f"a decode cache needs room for at least 1 token, got room={room!r}")
        n = keys[0].shape[-2]
        if hidden is not None and (hidden.dtype != torch.bool or tuple(hidden.shape) != (n,)):
            raise ValueError(
                f"hidden must be a bool mask over the prompt's {n} positions, got {hidden.dtype} {tuple(hidden.shape)}"
            )
        if any(k.dim() == 4 and k.shape[0] != 1 for k in keys):
            raise ValueError(f"a decode cache holds one sequence; got keys of shape {tuple(keys[0].shape)}")
        if self.keys and len(keys) != len(self.keys):
            raise ValueError(f"the pool holds {len(self.keys)} layers; got a cache of {len(keys)}")
        slot = next((s for s, r in enumerate(self.rows) if r is None), len(self.rows))
        self._fit(slot + 1, n + room, keys)
        for buf_k, buf_v, k, v in zip(self.keys, self.values, keys, values, strict=True):
            buf_k[slot, :, :n] = k.reshape(k.shape[-3:])  # [H_kv, N, D]
            buf_v[slot, :, :n] = v.reshape(v.shape[-3:])  # [H_kv, N, D]
        masked = None if hidden is None or not hidden.any() else hidden.to(self.keys[0].device)  # [N]
        cache = DecodeCache(self, slot, n, n + room, masked)
        self.rows[slot : slot + 1] = [cache]
        return cache

    def release(self, slot: int) -> None:
        self.rows[slot] = None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        if not self.rows:  # nothing decoding: the buffers are let go
            self.keys, self.values = [], []

    def _fit(self, slots: int, capacity: int, like: Sequence[torch.Tensor]) -> None:
        """Buffers with at least `slots` slots of `capacity` positions (slots doubled when more are needed,
        positions to the longest sequence's), the filled part copied over; `like`: a prompt's per-layer keys."""
        have_s, have_c = (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)
        if slots <= have_s and capacity <= have_c:
            return
        s = have_s if slots <= have_s else max(slots, 2 * have_s)  # a longer sequence alone adds no slot
        shape = (s, like[0].shape[-3], max(capacity, have_c), like[0].shape[-1])  # [S, H_kv, C, D]

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = like[0].new_zeros(
                shape
            )  # [S, H_kv, C, D]; zeros: a masked position's value weighs 0, and 0 * NaN is NaN
            if old is not None:
                new[:have_s, :, :have_c] = old
            return new

        self.keys = [grown(self.keys[layer] if self.keys else None) for layer in range(len(like))]
        self.values = [grown(self.values[layer] if self.values else None) for layer in range(len(like))]


@dataclass(frozen=True)
class RowStep:
    """Where B rows of a pool write and read in one step of M tokens each: `slots` [B] and `positions`
    [B, M] (a row's new tokens go at its length onwards), the slots attended `rows` (0..R-1: slots not
    stepping are attended too and their outputs dropped, so the pool is read as one block) and the mask
    [R, 1, G * M, T] of the positions each query sees (its row's up to itself, less those the row hides; T: the
    furthest row's last position + 1), over the G query heads of a KV head folded into the query axis."""

    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B, M]
    rows: int
    span: int
    visible: torch.Tensor  # [R, 1, G * M, T]
    dense: bool  # slots == 0..B-1: rows are read and written without a scatter

    @classmethod
    def of(cls, pool: DecodePool, caches: Sequence[DecodeCache], width: int, groups: int) -> RowStep:
        """The layout of one step that feeds `width` tokens to each of `caches` (all `pool`'s, open, with
        room), for `groups` query heads per KV head; built once for every layer."""
        device = pool.keys[0].device
        slots = [c.slot for c in caches]
        lengths = torch.tensor([c.length for c in caches], device=device)  # [B]
        positions = lengths[:, None] + torch.arange(width, device=device)  # [B, M]
        rows, span = max(slots) + 1, max(c.length for c in caches) + width
        index = torch.tensor(slots, device=device)  # [B]
        visible = torch.zeros(rows, width, span, dtype=torch.bool, device=device)  # [R, M, T]
        visible[:, :, 0] = True  # a slot not stepping sees one position: its (dropped) output stays finite
        visible[index] = torch.arange(span, device=device) <= positions[:, :, None]  # [B, M, T]
        for c in caches:
            if c.hidden is not None:
                visible[c.slot, :, : c.hidden.shape[0]] &= ~c.hidden  # [M, N]
        folded = (
            visible[:, None, None].expand(rows, 1, groups, width, span).reshape(rows, 1, groups * width, span)
        )  # [R, 1, G * M, T]
        return cls(index, positions, rows, span, folded, slots == list(range(rows)))


def attend_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    step: RowStep,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer of a step of M tokens for each of B rows: write their k, v [H_kv, B * M, D] (row-major)
    at their positions in the pool's buffers [S, H_kv, C, D], attend their q [H_q, B * M, D] over their
    own rows' positions in one call. The G query heads of a KV head are folded into the query axis, so
    keys are never repeated. Returns [B * M, H_q * D]."""
    (b, m), (h_kv, _, d) = step.positions.shape, k.shape
    keys[step.slots[:, None], :, step.positions] = k.view(h_kv, b, m, d).permute(1, 2, 0, 3)  # [B, M, H_kv, D]
    values[step.slots[:, None], :, step.positions] = v.view(h_kv, b, m, d).permute(1, 2, 0, 3)  # [B, M, H_kv, D]
    grouped = q.view(h_kv, -1, b, m, d).permute(2, 0, 1, 3, 4).reshape(b, h_kv, -1, d)  # [B, H_kv, G * M, D]
    if not step.dense:
        grouped = grouped.new_zeros(step.rows, *grouped.shape[1:]).index_copy_(
            0, step.slots, grouped
        )  # [R, H_kv, G * M, D]
    out = F.scaled_dot_product_attention(
        grouped,
        keys[: step.rows, :, : step.span],
        values[: step.rows, :, : step.span],
        attn_mask=step.visible,
        scale=scale,
    )  # [R, H_kv, G * M, D]
    if not step.dense:
        out = out[step.slots]  # [B, H_kv, G * M, D]
    return out.view(b, h_kv, -1, m, d).permute(0, 3, 1, 2, 4).reshape(b * m, -1)  # [B * M, H_q * D]
