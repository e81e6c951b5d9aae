"""What every command shares: the Typer app and its global options, the consoles, errors, and the configuration
read from the environment (this CLI is its one edge). The options derived from the config fields are `options`'."""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..config import Config
from ..version import __version__
from .options import DType

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="RAG that never prefills the same chunk twice.",
)
out = Console()
err = Console(stderr=True)


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


def check_method(name: str) -> None:
    """Refuse a method the registry does not know (read now, so methods registered after import count)."""
    from ..engine.methods import METHODS

    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown fusion method {name!r}{hint} (registered: {', '.join(METHODS)})")
