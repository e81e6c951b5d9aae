"""Building an index's chunk caches: batched forward passes with the writes behind them
(`precompute`), and the same spread over a Ray cluster (`cluster`, needs `rag-kvcache[ray]`)."""
