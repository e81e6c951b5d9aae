"""Benchmark helpers: datasets, quality/latency metrics and reports."""
