"""How a cache tensor is stored on disk: as is, int8 with per-channel or per-token scales, fp8, or int8 keys
with 4-bit values.

A codec names, for keys and for values (`Codec.of`), the `TensorCodec` that turns one such tensor [H_kv, T, D]
into named parts (the suffix "" is the payload, others are side data such as scales) and back. Symmetric
scales are absmax / the format's largest value, kept in float32; per-channel scales are shared by all tokens of
a head dimension ([H_kv, 1, D]), per-token scales by all dimensions of a token ([H_kv, T, 1]). Per-channel suits
keys (their outlier channels are fixed), per-token suits values. 4-bit values are asymmetric (a scale and a low
end per channel and group of 64 tokens), two a byte. Keys are never stored at 4 bits, nor are the values of an
entry at a sequence's start, whose attention-sink token's outlier values a 4-bit range cannot hold: either moves
fused answers measurably, where the chunk caches' 4-bit values do not (`benchmarks/storage/codec_bits.py`).

`CODECS` implements each name `config.CodecName` lists (the config validates a name, and the CLI
offers them, from that list; `tests/unit/test_storage.py` holds the two equal).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import CodecName

if TYPE_CHECKING:
    from ..engine.interface import KVLayout


class TensorCodec(Protocol):
    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(
        self, parts: dict[str, torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor `parts` encode, in `dtype` (into `out`, of that dtype and shape, when given)."""
        ...

    def nbytes(self, h_kv: int, t: int, d: int, dtype: torch.dtype) -> int:
        """Bytes stored for one tensor [H_kv, T, D] of `dtype` (payload and side data)."""
        ...


class Codec(Protocol):
    name: str

    def of(self, kind: str, at_start: bool = False) -> TensorCodec:
        """How the keys ("k") or the values ("v") of an entry are stored; `at_start`: of an entry that holds a
        sequence's first positions (the system prefix's cache, or any cache computed behind nothing), whose
        attention-sink token carries the outlier values a 4-bit range per channel cannot hold."""
        ...


@dataclass(frozen=True)
class Raw:
    name: str = "none"

    def of(self, kind: str, at_start: bool = False) -> TensorCodec:
        return self

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"": t}

    def decode(
        self, parts: dict[str, torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return parts[""].to(dtype) if out is None else out.copy_(parts[""])

    def nbytes(self, h_kv: int, t: int, d: int, dtype: torch.dtype) -> int:
        return h_kv * t * d * dtype.itemsize


@dataclass(frozen=True)
class Scaled:
    """Symmetric quantisation to the torch dtype named `qdtype` with an absmax scale reduced over `reduce_dim`."""

    name: str
    qdtype: str
    qmax: float
    reduce_dim: int  # 1: one scale per channel over tokens; -1: one scale per token over channels

    def of(self, kind: str, at_start: bool = False) -> TensorCodec:
        return self

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        qdtype = getattr(torch, self.qdtype)
        x = t.float()  # [H_kv, T, D]
        scale = (x.abs().amax(dim=self.reduce_dim, keepdim=True) / self.qmax).clamp_min(
            1e-12
        )  # [H_kv, 1, D] or [H_kv, T, 1]
        q = x / scale  # [H_kv, T, D]
        q = q.round().clamp(-self.qmax, self.qmax) if not qdtype.is_floating_point else q
        return {"": q.to(qdtype), "scale": scale}

    def decode(
        self, parts: dict[str, torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = parts[""]  # [H_kv, T, D]
        q = q.float() if q.dtype.is_floating_point else q  # float8 does not promote; int8 does, in the product
        if out is not None and out.dtype == torch.float32:
            return torch.mul(q, parts["scale"], out=out)  # [H_kv, T, D]
        decoded = torch.mul(q, parts["scale"]).to(dtype)  # [H_kv, T, D], float32 before the cast
        return decoded if out is None else out.copy_(decoded)

    def nbytes(self, h_kv: int, t: int, d: int, dtype: torch.dtype) -> int:
        scales = h_kv * d if self.reduce_dim == 1 else h_kv * t  # float32 each
        return h_kv * t * d + 4 * scales  # int8 and fp8 take one byte an element


@dataclass(frozen=True)
class Packed4:
    """Asymmetric 4-bit quantisation per channel and group of `group` consecutive tokens (the last group shorter):
    levels 0..15 between the low and high end of each channel over the group's tokens, two channels a byte (channel
    i of the first half in the low nibble, channel i of the second half in the high one: unpacked by one
    concatenation). Groups keep a long chunk's values as close as a short chunk's: one range over a whole
    512-token chunk doubled a teacher-forced answer's deviation against one over 128 tokens. An entry stored
    with one range for all its tokens (scales [H_kv, 1, D]: any of at most `group` tokens, and those of an index
    built with one range a chunk) reads back as stored."""

    group: int = 64

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if t.shape[-1] % 2:
            raise ValueError(f"4-bit packing needs an even head_dim, got a tensor of shape {tuple(t.shape)}")
        h, n, d = t.shape
        groups = -(-n // self.group)
        x = t.float()  # [H_kv, T, D]
        padded = torch.cat([x, x[:, -1:].expand(h, groups * self.group - n, d)], dim=1)  # [H_kv, G * group, D]
        grouped = padded.view(h, groups, self.group, d)  # [H_kv, G, group, D]; the last token repeated: same range
        low = grouped.amin(dim=2)  # [H_kv, G, D]
        scale = ((grouped.amax(dim=2) - low) / 15).clamp_min(1e-12)  # [H_kv, G, D]
        levels = ((grouped - low[:, :, None]) / scale[:, :, None]).round().clamp(0, 15)  # [H_kv, G, group, D]
        q = levels.to(torch.uint8).view(h, groups * self.group, d)[:, :n]  # [H_kv, T, D]
        half = d // 2
        return {"": q[..., :half] | (q[..., half:] << 4), "scale": scale, "low": low}  # payload [H_kv, T, D / 2]

    def decode(
        self, parts: dict[str, torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed, scale, low = parts[""], parts["scale"], parts["low"]  # [H_kv, T, D / 2], [H_kv, G, D] twice
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [H_kv, T, D]
        into = out if out is not None and out.dtype == torch.float32 else None
        group = self.group if scale.shape[1] > 1 else max(q.shape[1], 1)  # one range: a single group of every token
        decoded = _addcmul_grouped(low, q, scale, group, into)  # [H_kv, T, D]
        if out is None:
            return decoded.to(dtype)
        return out if decoded is out else out.copy_(decoded)

    def nbytes(self, h_kv: int, t: int, d: int, dtype: torch.dtype) -> int:
        # half a byte an element; a float32 scale and low end a channel and group
        return h_kv * t * d // 2 + 2 * 4 * h_kv * d * -(-t // self.group)


def _addcmul_grouped(
    low: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor | None
) -> torch.Tensor:
    """low + q * scale with one low end and scale per group of `group` tokens: the whole groups through a view,
    the shorter last one on its own (two products, however many groups)."""
    h, n, d = q.shape
    whole = n // group
    out = torch.empty_like(q) if out is None else out  # [H_kv, T, D], float32
    head = out[:, : whole * group].view(h, whole, group, d)  # [H_kv, G', group, D]
    torch.addcmul(
        low[:, :whole, None], q[:, : whole * group].view(h, whole, group, d), scale[:, :whole, None], out=head
    )
    if whole * group < n:
        torch.addcmul(
            low[:, whole:], q[:, whole * group :], scale[:, whole:], out=out[:, whole * group :]
        )  # [H_kv, T % group, D]
    return out


@dataclass(frozen=True)
class Split:
    """Keys by one tensor codec, values by another, but for an entry at a sequence's start, whose values are
    stored as its keys are. An entry's shape is its keys' (stored unpacked)."""

    name: str
    keys: TensorCodec
    values: TensorCodec

    def of(self, kind: str, at_start: bool = False) -> TensorCodec:
        return self.keys if kind == "k" or at_start else self.values


INT8_CHANNEL = Scaled("int8-channel", "int8", 127.0, reduce_dim=1)
CODECS: dict[CodecName, Codec] = {  # the names `config.CodecName` accepts, each implemented
    "none": Raw(),
    "int8-channel": INT8_CHANNEL,
    "int8-token": Scaled("int8-token", "int8", 127.0, reduce_dim=-1),
    "fp8": Scaled("fp8", "float8_e4m3fn", 448.0, reduce_dim=1),  # 448: torch.finfo(torch.float8_e4m3fn).max
    "int8k-int4v": Split("int8k-int4v", INT8_CHANNEL, Packed4()),
}


def entry_codecs(codec: Codec, position: int) -> tuple[TensorCodec, TensorCodec]:
    """How the keys and the values of an entry whose first token is at `position` are stored: a cache at position 0
    holds a sequence's start (`Codec.of`'s `at_start`)."""
    return codec.of("k", position == 0), codec.of("v", position == 0)


def cache_nbytes(codec: Codec, layout: KVLayout, lengths: Iterable[int], position: int) -> int:
    """Bytes the caches of chunks of these token counts take when `codec` stores them (payload and side
    data; each file's header aside: `backend.header_nbytes`), each cache's first token at `position`."""
    per_layer = sum(
        tensor_codec.nbytes(layout.n_kv_heads, t=n, d=layout.head_dim, dtype=layout.dtype)
        for n in lengths
        for tensor_codec in entry_codecs(codec, position)
    )
    return layout.n_layers * per_layer


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; available: {', '.join(CODECS)}")
    return CODECS[name]
