"""`ConversationCache`: the K/V of prompts already fused (kept once their first token is out, before their
second, so that the same prompt sent again while the first is still decoding reads them) and, once answered,
of their answers, kept in memory and found by token ids, so that a chat's next turn (the same prompt, the
answer, a new message) computes only what is new.

A radix tree over token ids per tenant (SGLang's RadixAttention): each node holds the K/V of its run
of tokens, computed behind every token on the path to it, so a prompt reads the longest path its
tokens begin with and a branch (two answers to one prompt, two chats over the same documents) shares
the common part once. A node records the fusion method that computed it. The K/V of an exact method
(`full`, `prefix`) equal what that method computes for the same tokens without the cache (to float
rounding), so an exact method reads only its own nodes, and writing a path with an exact method
makes every node on it that method's (their K/V replaced). The K/V of an inexact method keep their
approximation as the fusion made it (a chunk read from its cache stays the fused one); an inexact
method reads any node, which is never worse than its own.

Each tenant's trees are bounded in bytes by the budget (`max_bytes`, per tenant): over it, the tenant's own
least recently used leaves go first (their parents may follow once they are leaves), so one tenant's chats
never evict another's. Tenants never share a tree: a hit is measurably faster, and a conversation holds its
user's text. A tree is a `salt`'s; the salt's tenant is its text before the first ':' (the server's salts
are `TENANT` or `TENANT:cache_salt`: a request's `cache_salt` splits a tenant's trees, never its budget).
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Node:
    """A run of tokens and its K/V [H_kv, T, D] per layer, computed behind the path from the root."""

    ids: tuple[int, ...]
    keys: list[torch.Tensor]  # L x [H_kv, T, D]
    values: list[torch.Tensor]  # L x [H_kv, T, D]
    method: str  # the fusion method that computed it
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the cache's clock at its last read or write

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


@dataclass(frozen=True)
class PathKV:
    """The K/V of the first `n_tokens` of a path of nodes, read a layer at a time (a `LayerSource` at
    position 0): each layer is its nodes' runs concatenated."""

    parts: tuple[tuple[torch.Tensor, ...], ...]  # per layer: keys then values of each node's run [H_kv, t, D]
    n_tokens: int
    position: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.parts)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        runs = self.parts[i]
        half = len(runs) // 2
        if half == 1:
            return runs[0], runs[1]  # [H_kv, T, D]
        return torch.cat(runs[:half], dim=1), torch.cat(runs[half:], dim=1)  # [H_kv, T, D]


@dataclass(frozen=True)
class ConversationHit:
    """The longest stored run a prompt begins with: its length and its K/V."""

    n_tokens: int
    kv: PathKV


@dataclass(frozen=True)
class ConversationStats:
    """Counts of the whole cache, or of one tenant's trees (`ConversationCache.stats_of`); `max_bytes` is the
    budget of each tenant."""

    nodes: int
    tokens: int  # tokens whose K/V are held
    bytes: int
    max_bytes: int
    lookups: int
    hits: int  # lookups that found at least one token
    hit_tokens: int  # prompt tokens read from the cache
    evicted_tokens: int


COUNTS = ("nodes", "tokens", "bytes", "lookups", "hits", "hit_tokens", "evicted_tokens")  # a tenant's, in a Counter


def tenant_of(salt: str) -> str:
    """The tenant a salt's tree belongs to: its text before the first ':'."""
    return salt.partition(":")[0]


class ConversationCache:
    """The K/V of fused prompts and their answers, per `salt`, within `max_bytes` per tenant (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a conversation cache needs a budget of at least 1 byte, got max_bytes={max_bytes!r}")
        self.max_bytes = max_bytes
        self._roots: dict[str, _Node] = {}
        self._accounts: dict[str, Counter[str]] = {}  # tenant -> its COUNTS
        self._lock = threading.Lock()
        self._clock = 0

    def _account(self, salt: str) -> Counter[str]:
        return self._accounts.setdefault(tenant_of(salt), Counter())

    def match(self, salt: str, ids: Sequence[int], method: str | None = None) -> ConversationHit | None:
        """The longest path of `salt`'s tree that `ids` begin with, at most all but the last token (the
        prompt's last token is always computed); `method` given: only that method's nodes (an exact
        method's). None when no token matches. Counted in the stats, and the path is marked used."""
        with self._lock:
            account = self._account(salt)
            account["lookups"] += 1
            self._clock += 1
            runs = self._walk(salt, ids, method)
            if not runs:
                return None
            n = sum(k for _, k in runs)
            account["hits"] += 1
            account["hit_tokens"] += n
            for node, _ in runs:
                node.used = self._clock
            layers = tuple(
                tuple(nd.keys[i][:, :k] for nd, k in runs) + tuple(nd.values[i][:, :k] for nd, k in runs)
                for i in range(len(runs[0][0].keys))
            )  # per layer: [H_kv, k, D] per run, keys then values
            return ConversationHit(n, PathKV(layers, n))

    def held(self, salt: str, ids: Sequence[int], method: str | None = None) -> int:
        """How many of `ids` `match` would read (`method`'s nodes only if given), without counting or using them."""
        with self._lock:
            return sum(k for _, k in self._walk(salt, ids, method))

    def insert(
        self,
        salt: str,
        ids: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        method: str,
        exact: bool,
    ) -> None:
        """Keep the K/V of `ids`: `keys`/`values` per layer [H_kv, >= len(ids), D], position i the K/V of
        ids[i] (a decoder's buffers: the stored runs are copies). Tokens already on a path are not stored
        again, unless `exact` (an exact `method`) finds another method's node there: its K/V become this
        method's. Then the least recently used leaves of the salt's tenant are evicted while that tenant is over
        its budget (no other tenant's are)."""
        ids = tuple(ids)
        with self._lock:
            self._clock += 1
            account = self._account(salt)
            node = self._roots.setdefault(salt, _Node((), [], [], "", None))
            n = 0
            while n < len(ids):
                child = node.children.get(ids[n])
                if child is None:
                    self._add(account, node, ids[n:], [k[:, n:] for k in keys], [v[:, n:] for v in values], method)
                    break
                k = _common(child.ids, ids[n:])
                if k < len(child.ids):
                    child = self._split(account, child, k)
                if exact and child.method != method:
                    account["bytes"] -= child.nbytes
                    child.keys = [t[:, n : n + k].clone() for t in keys]  # L x [H_kv, k, D]
                    child.values = [t[:, n : n + k].clone() for t in values]
                    child.method = method
                    account["bytes"] += child.nbytes
                child.used = self._clock
                node, n = child, n + k
            self._evict(tenant_of(salt), account)

    @property
    def stats(self) -> ConversationStats:
        """The whole cache's counts (every tenant's summed)."""
        with self._lock:
            return self._stats(list(self._accounts.values()))

    def stats_of(self, tenant: str) -> ConversationStats:
        """One tenant's counts (zeros for a tenant never seen)."""
        with self._lock:
            return self._stats([self._accounts.get(tenant, Counter())])

    def tenants(self) -> dict[str, ConversationStats]:
        """Every tenant seen so far and its counts."""
        with self._lock:
            return {tenant: self._stats([account]) for tenant, account in self._accounts.items()}

    def _stats(self, accounts: list[Counter[str]]) -> ConversationStats:
        total: Counter[str] = sum(accounts, Counter())
        return ConversationStats(max_bytes=self.max_bytes, **{name: total[name] for name in COUNTS})

    # ---- the tree, under the lock --------------------------------------------------------------
    def _walk(self, salt: str, ids: Sequence[int], method: str | None) -> list[tuple[_Node, int]]:
        """The nodes `ids` (all but the last) run through and how many tokens of each, `method`'s only if given."""
        node, n, limit = self._roots.get(salt), 0, len(ids) - 1
        runs: list[tuple[_Node, int]] = []
        while node is not None and n < limit:
            child = node.children.get(ids[n])
            if child is None or (method is not None and child.method != method):
                break
            k = _common(child.ids, ids[n:limit])
            runs.append((child, k))
            n += k
            node = child if k == len(child.ids) else None
        return runs

    def _add(
        self,
        account: Counter[str],
        parent: _Node,
        ids: tuple[int, ...],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        method: str,
    ) -> _Node:
        node = _Node(
            ids,
            [k[:, : len(ids)].clone() for k in keys],
            [v[:, : len(ids)].clone() for v in values],
            method,
            parent,
            used=self._clock,
        )  # L x [H_kv, T, D], copies
        parent.children[ids[0]] = node
        account["nodes"] += 1
        account["tokens"] += len(ids)
        account["bytes"] += node.nbytes
        return node

    def _split(self, account: Counter[str], node: _Node, k: int) -> _Node:
        """Cut `node` after its first k tokens: a new node holding them takes its place, `node` keeps the
        rest as its child. Returns the new node."""
        head = _Node(
            node.ids[:k],
            [t[:, :k].clone() for t in node.keys],
            [t[:, :k].clone() for t in node.values],
            node.method,
            node.parent,
            used=node.used,
        )  # L x [H_kv, k, D]
        node.parent.children[head.ids[0]] = head
        node.ids = node.ids[k:]
        node.keys = [t[:, k:].clone() for t in node.keys]  # L x [H_kv, T - k, D]
        node.values = [t[:, k:].clone() for t in node.values]
        node.parent = head
        head.children[node.ids[0]] = node
        account["nodes"] += 1
        return head

    def _leaves(self, tenant: str) -> Iterator[_Node]:
        """The leaves of `tenant`'s trees."""
        stack = [root for salt, root in self._roots.items() if tenant_of(salt) == tenant]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.parent is not None:
                yield node

    def _drop(self, account: Counter[str], node: _Node) -> None:
        del node.parent.children[node.ids[0]]
        account["nodes"] -= 1
        account["tokens"] -= len(node.ids)
        account["bytes"] -= node.nbytes

    def _evict(self, tenant: str, account: Counter[str]) -> None:
        """Drop `tenant`'s least recently used leaves while its trees are over the budget."""
        if account["bytes"] <= self.max_bytes:
            return
        heap = [(leaf.used, id(leaf), leaf) for leaf in self._leaves(tenant)]
        heapq.heapify(heap)
        while account["bytes"] > self.max_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            self._drop(account, leaf)
            account["evicted_tokens"] += len(leaf.ids)
            parent = leaf.parent
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.used, id(parent), parent))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
