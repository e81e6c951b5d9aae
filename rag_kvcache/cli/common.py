"""What every command shares: the Typer app and its global options, the consoles, the options derived
from the config fields, and the configuration read from the environment (this CLI is its one edge)."""

from __future__ import annotations

import difflib
import logging
import os
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional, get_args, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape

from ..bench.datasets import EVIDENCE_PLACES, FORMATS
from ..bench.prompts import PROMPT_STYLES
from ..config import (
    CHUNK_ORDERS,
    CHUNK_PREFILLS,
    CODEC_NAMES,
    DTYPE_NAMES,
    EMBEDDER_DTYPES,
    Config,
    Deviation,
    IndexSettings,
    RuntimeConfig,
    StorageConfig,
)
from ..serving.settings import ServerConfig
from ..version import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="RAG that never prefills the same chunk twice.",
)
out = Console()
err = Console(stderr=True)

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


def base_config() -> Config:
    """The defaults, with what this process's environment sets: the model cache folder and the remote tier's secret."""
    cfg = Config()
    if cache_dir := os.environ.get("RAG_KVCACHE_CACHE_DIR"):
        cfg = cfg.with_runtime(cache_dir=Path(cache_dir))
    if secret := os.environ.get("RAG_KVCACHE_KV_REMOTE_SECRET"):
        cfg = cfg.with_storage(remote_secret=secret.encode())
    return cfg


def placed(cfg: Config, device: str | None, dtype: DType | None) -> Config:
    """`cfg` with the `--device` and `--dtype` given (each left as it is when not given)."""
    return cfg.placed(device, None if dtype is None else dtype.value)


def model_process() -> None:
    """Process-wide settings of a command that loads a model (this CLI is their edge; the library sets none):
    transformers' weight-loading bars hidden (noise here), and PyTorch's cuDNN attention off. On CUDA,
    SDPA otherwise picks cuDNN's kernel, which builds a plan for every new sequence length, so every prompt
    and every decoding step of a new length pays it: on an H100 (1.1B Llama, side by side over 8 new
    lengths of 2,000-3,100 tokens, benchmarks/gpu/sdpa_backends.py) a full prefill took 100 ms with it and
    22 ms without, a decoding step 82 and 18 ms. Flash and memory-efficient attention stay; no effect on CPU."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.backends.cuda.enable_cudnn_sdp(False)


def _show_version(value: bool) -> None:
    if value:
        out.print(f"rag-kvcache {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )
    logging.getLogger("rag_kvcache").setLevel(logging.DEBUG if verbose else logging.INFO)


def path_arg(value: str, name: str) -> Path:
    """A path argument, refused when empty (an empty string would mean the current directory)."""
    if not value.strip():
        fail(f"{name} is empty: name a folder (use '.' for the current one)")
    return Path(value)


def fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)  # escaped: "rag-kvcache[serve]" is no markup
    raise typer.Exit(2)


def was_given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was set by the user rather than left at its default."""
    # By name: typer >= 0.29 runs on its own copy of click, whose ParameterSource is not click's.
    return ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP")


def parse_ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--ratio must be a number in [0, 1] or 'auto', got {text!r}") from None


def check_method(name: str) -> None:
    """Refuse a method the registry does not know (read now, so methods registered after import count)."""
    from ..engine.methods import METHODS

    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown fusion method {name!r}{hint} (registered: {', '.join(METHODS)})")
