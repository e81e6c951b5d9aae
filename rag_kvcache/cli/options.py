"""The options commands share, derived from the config fields (`option`, `default`) with the types of their
choices, and how a command's parameters become a config's arguments (`fields_of`)."""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Optional, get_args, get_type_hints

import typer

from ..bench.datasets import EVIDENCE_PLACES, FORMATS
from ..bench.prompts import PROMPT_STYLES
from ..config import (
    CHUNK_ORDERS,
    CHUNK_PREFILLS,
    CODEC_NAMES,
    DTYPE_NAMES,
    EMBEDDER_DTYPES,
    Deviation,
    IndexSettings,
    RuntimeConfig,
    StorageConfig,
)
from ..serving.settings import ServerConfig

INDEX_HELP = "An index built by `rag-kvcache index`."

KVCodec = Enum("KVCodec", {name: name for name in CODEC_NAMES}, type=str)
DeviationName = Enum("DeviationName", {name: name for name in get_args(Deviation)}, type=str)
DatasetFormat = Enum("DatasetFormat", {name: name for name in FORMATS}, type=str)
PromptStyle = Enum("PromptStyle", {name: name for name in PROMPT_STYLES}, type=str)
EvidencePlace = Enum("EvidencePlace", {name: name for name in EVIDENCE_PLACES}, type=str)
DType = Enum("DType", {name: name for name in DTYPE_NAMES}, type=str)
EmbedderDType = Enum("EmbedderDType", {name: name for name in EMBEDDER_DTYPES}, type=str)
ChunkPrefillName = Enum("ChunkPrefillName", {name: name for name in CHUNK_PREFILLS}, type=str)
ChunkOrderName = Enum("ChunkOrderName", {name: name for name in CHUNK_ORDERS}, type=str)
Order = Enum("Order", {name: name for name in get_args(get_type_hints(ServerConfig)["order"])}, type=str)
History = Enum("History", {name: name for name in get_args(get_type_hints(ServerConfig)["history"])}, type=str)


def default(cls: type, name: str) -> Any:
    """The default of config field `cls.name`."""
    return cls.__dataclass_fields__[name].default


def option(cls: type, name: str, *decls: str, **kwargs: Any) -> Any:
    """A typer option for config field `cls.name`, with the field's help text."""
    return typer.Option(*decls, help=cls.__dataclass_fields__[name].metadata["help"], **kwargs)


def fields_of(cls: type, params: dict[str, Any], **more: Any) -> dict[str, Any]:
    """The keyword arguments of config `cls` that a command's `params` (its `locals()` on entry) give under its
    fields' names, a choice as its value, updated with `more` (fields whose option is named or parsed otherwise)."""
    given = {name: params[name] for name in cls.__dataclass_fields__ if name in params}
    return {name: value.value if isinstance(value, Enum) else value for name, value in given.items()} | more


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count as people write one: 2000000, 500MB, 1.5GiB, 20G (decimal units; 'i' for binary ones)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if found is None:
        raise typer.BadParameter(f"{text!r} is not a size: write bytes, or a number with a unit (500MB, 1.5GiB)")
    value = int(float(found[1]) * _UNITS[(found[2] or "").lower()])
    if value < 1:
        raise typer.BadParameter(f"{text!r} is not a positive size")
    return value


KVBudget = Annotated[
    Optional[int], option(StorageConfig, "disk_bytes", "--kv-budget", parser=parse_bytes, metavar="SIZE")
]
KVRemote = Annotated[Optional[str], option(StorageConfig, "remote", "--kv-remote")]
KVRemoteWritable = Annotated[bool, option(StorageConfig, "remote_writable", "--kv-remote-writable")]
KVOnDevice = Annotated[bool, option(StorageConfig, "memory_on_device", "--kv-on-device/--kv-in-host")]
# --device and --dtype of a command that opens an index: not given, the index's own setting stands
PlacedDevice = Annotated[Optional[str], option(RuntimeConfig, "device")]
PlacedDType = Annotated[Optional[DType], option(IndexSettings, "dtype")]


def parse_ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--ratio must be a number in [0, 1] or 'auto', got {text!r}") from None
