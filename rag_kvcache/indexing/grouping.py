"""Groups of similar chunks, for `chunk_prefill="grouped"`: each group is prefilled as one sequence, so every
chunk's cache is computed behind the similar chunks before it in its group, at the cost of one forward over
the group's tokens (`CacheMaker.precompute_grouped`).

`similar_groups` is greedy and deterministic: the chunks are taken in order; the first one not yet in a
group seeds a new group, which takes the seed's most similar chunks not yet in a group (by cosine of their
embeddings, an exact search), most similar first, until it holds `size`. A group can be smaller when the
seed's nearest chunks are taken already (the search looks at `SEARCH_WIDTH` x `size` of them).
"""

from __future__ import annotations

import faiss
import numpy as np

SEARCH_WIDTH = 4  # a seed looks for its group among this many times the group size of its nearest chunks


def similar_groups(embeddings: np.ndarray, size: int) -> list[list[int]]:
    """A partition of the rows of `embeddings` [C, E] into groups of at most `size`, each a seed and then
    its most similar rows (see the module); every row is in exactly one group, in the order it is laid out."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size!r}")
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [C, E], got shape {embeddings.shape}")
    n = embeddings.shape[0]
    if n == 0:
        return []
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)  # [C, E]
    faiss.normalize_L2(vectors)  # cosine as an inner product
    search = faiss.IndexFlatIP(vectors.shape[1])
    search.add(vectors)
    _, nearest = search.search(vectors, min(n, SEARCH_WIDTH * size))  # [C, W], most similar first
    grouped = np.zeros(n, dtype=bool)
    groups: list[list[int]] = []
    for seed in range(n):
        if grouped[seed]:
            continue
        group = [seed]
        grouped[seed] = True
        for j in nearest[seed]:
            if len(group) == size:
                break
            if j >= 0 and not grouped[j]:
                group.append(int(j))
                grouped[j] = True
        groups.append(group)
    return groups
