"""Groups of similar chunks, for `chunk_prefill="grouped"`: each group is prefilled as one sequence, so every
chunk's cache is computed behind the similar chunks before it in its group, at the cost of one forward over
the group's tokens (`CacheMaker.precompute_grouped`).

`similar_groups` is greedy and deterministic: the chunks are taken in order; the first one not yet in a
group seeds a new group, which takes the seed's most similar chunks not yet in a group (by cosine of their
embeddings, an exact search), most similar first, until it holds `size`. A group can be smaller when the
seed's nearest chunks are taken already (the search looks at `SEARCH_WIDTH` x `size` of them).

`earlier_neighbours` (for `chunk_prefill="chained"`) finds, for each group, the rows of the groups before it most
similar to it: what the group is prefilled behind, read from their caches.
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
    vectors = unit_rows(embeddings)  # [C, E]
    n = vectors.shape[0]
    if n == 0:
        return []
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


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    """`embeddings` [C, E] as float32 rows of norm 1 (cosine as an inner product)."""
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [C, E], got shape {embeddings.shape}")
    vectors = np.array(embeddings, dtype=np.float32)  # [C, E], a copy normalised in place
    faiss.normalize_L2(vectors)
    return vectors


def earlier_neighbours(embeddings: np.ndarray, groups: list[list[int]], count: int) -> list[list[int]]:
    """For each of `groups` (a partition of the rows of `embeddings` [C, E], in the order they are computed), up
    to `count` rows of the groups before it, most similar to the group's mean direction first (an exact search
    over `SEARCH_WIDTH` x (`count` + the largest group) nearest rows, so a group whose nearest rows are mostly
    later ones gets fewer). The first group gets none."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    if not groups or count == 0:
        return [[] for _ in groups]
    vectors = unit_rows(embeddings)  # [C, E]
    order = np.empty(vectors.shape[0], dtype=np.int64)  # row -> the number of its group
    for g, rows in enumerate(groups):
        order[rows] = g
    centres = unit_rows(np.stack([vectors[rows].mean(0) for rows in groups]))  # [G, E]
    search = faiss.IndexFlatIP(vectors.shape[1])
    search.add(vectors)
    width = min(vectors.shape[0], SEARCH_WIDTH * (count + max(map(len, groups))))
    _, nearest = search.search(centres, width)  # [G, W], most similar first
    return [[int(j) for j in row if j >= 0 and order[j] < g][:count] for g, row in enumerate(nearest)]
