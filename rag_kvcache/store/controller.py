"""The loading controller (CacheBlend §5.1): choose the recompute ratio and the storage tier together.

`calibrate` measures, once per machine, model and codec, the read throughput of each tier (memory,
disk through a warm page cache, disk cold; each as the fusion's reader delivers a layer to the
model's device, so the memory tier of a CPU model costs next to nothing) and the prefill time per
token per layer, and saves them under `cache_dir/calibration/`. With them, for a context of L tokens and a cache of b bytes per
token per layer (stored, so codec included):

    T_load(tier)   = L * b / throughput(tier)              per layer
    T_recompute(r) = r * L * prefill_s_per_token_layer     per layer

`choose_ratio` picks r = max(floor, r*) with T_recompute(r*) = T_load (L cancels): the recompute of
layer i then hides the loading of layer i+1, and the floor (default 15%) keeps quality.
`choose_tier` answers the converse: for a fixed r, the cheapest tier whose loading adds no delay.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..config import Config, StorageConfig
from ..engine.cache import ChunkKV, pack_layer
from ..engine.model import ModelAdapter
from ..engine.spec import ModelSpec
from ..errors import RagKVCacheError
from .kvstore import KVStore

log = logging.getLogger(__name__)

TIERS_BY_COST = ("disk", "memory")  # storable tiers, cheapest first
MEASURED_TIERS = ("memory", "page_cache", "disk")  # page_cache: the disk tier with its pages cached


@dataclass(frozen=True)
class Calibration:
    """Speeds measured on one machine for one model and codec."""

    machine: str
    model_fingerprint: str
    codec: str
    bytes_per_token_layer: float  # stored K+V bytes of one token in one layer
    read_bytes_per_s: dict[str, float]  # tier -> stored bytes delivered per second (verify, decode included)
    prefill_s_per_token_layer: float
    measured_at: str

    def load_s(self, tier: str, n_tokens: int) -> float:
        """Seconds to read one layer of `n_tokens` tokens' caches from `tier`."""
        if tier not in self.read_bytes_per_s:
            raise ValueError(f"unknown tier {tier!r}; measured: {', '.join(self.read_bytes_per_s)}")
        return n_tokens * self.bytes_per_token_layer / self.read_bytes_per_s[tier]

    def recompute_s(self, ratio: float, n_tokens: int) -> float:
        """Seconds to recompute `ratio` of `n_tokens` tokens in one layer."""
        return ratio * n_tokens * self.prefill_s_per_token_layer


@dataclass(frozen=True)
class Decision:
    """A recompute ratio and tier, with the numbers behind them (per layer, for `n_tokens`)."""

    ratio: float
    tier: str
    n_tokens: int
    balanced_ratio: float  # the ratio whose recompute time equals the loading time
    floor: float  # the quality floor (for `choose_tier`: the fixed ratio)
    load_s: float
    recompute_s: float

    @property
    def adds_delay(self) -> bool:
        return self.load_s > self.recompute_s

    def explain(self) -> str:
        rule = (
            "quality floor"
            if self.balanced_ratio <= self.floor
            else "load = recompute, capped at 1"
            if self.balanced_ratio > 1
            else "load = recompute"
        )
        return (
            f"ratio {self.ratio:.3f} ({rule}: balanced {self.balanced_ratio:.3f}, floor {self.floor:.2f}) from tier "
            f"{self.tier}, {self.n_tokens} context tokens: per layer load {self.load_s * 1e3:.2f} ms, recompute "
            f"{self.recompute_s * 1e3:.2f} ms{' (loading adds delay)' if self.adds_delay else ''}"
        )


def choose_ratio(cal: Calibration, tier: str, n_tokens: int, floor: float = 0.15) -> Decision:
    """The paper's rule: max(floor, the ratio whose recompute time equals the loading time)."""
    load = cal.load_s(tier, n_tokens)
    balanced = load / cal.recompute_s(1.0, n_tokens)
    ratio = min(1.0, max(floor, balanced))
    return Decision(ratio, tier, n_tokens, balanced, floor, load, cal.recompute_s(ratio, n_tokens))


def choose_tier(cal: Calibration, ratio: float, n_tokens: int) -> Decision:
    """The cheapest storable tier whose loading hides behind recomputing `ratio` (the fastest if none does)."""
    decisions = [
        Decision(
            ratio,
            tier,
            n_tokens,
            cal.load_s(tier, n_tokens) / cal.recompute_s(1.0, n_tokens),
            ratio,
            cal.load_s(tier, n_tokens),
            cal.recompute_s(ratio, n_tokens),
        )
        for tier in TIERS_BY_COST
    ]
    return next((d for d in decisions if not d.adds_delay), min(decisions, key=lambda d: d.load_s))


def resolve_ratio(config: Config, adapter: ModelSpec, tier: str = "disk") -> tuple[Config, Decision | None]:
    """`config` with a number for CacheBlend's ratio: `ratio="auto"` becomes the loading controller's
    choice for `top_k * chunk_tokens` context tokens whose caches come from `tier`, from this machine's
    calibration for `adapter`'s model and `config`'s codec (with the decision); a number is kept (no decision).
    The one place `auto` is resolved (`ask` and `bench` both call it)."""
    if config.query.fusion.ratio != "auto":
        return config, None
    cal = load_calibration(config.runtime.cache_dir, adapter, config.index.codec)
    decision = choose_ratio(
        cal, tier, config.query.top_k * config.index.chunk_tokens, config.runtime.storage.quality_floor
    )
    return config.with_fusion(ratio=decision.ratio), decision


# ---- measuring ------------------------------------------------------------------------------------
def machine_id(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return f"{platform.node()}-{device.type}-{name}".replace("/", "_").replace(" ", "_")


def calibration_path(cache_dir: Path, adapter: ModelSpec, codec: str) -> Path:
    return Path(cache_dir) / "calibration" / f"{machine_id(adapter.device)}-{adapter.fingerprint[:16]}-{codec}.json"


class NotCalibratedError(RagKVCacheError, ValueError):
    """`ratio="auto"` asked on a machine where the model was never calibrated: a setting the request (or the
    command) chose, not a fault of the server's files."""


def load_calibration(cache_dir: Path, adapter: ModelSpec, codec: str) -> Calibration:
    path = calibration_path(cache_dir, adapter, codec)
    if not path.is_file():
        raise NotCalibratedError(
            f"no calibration for model {adapter.name} (codec {codec}) on this machine at {path}: "
            "run `rag-kvcache calibrate --index INDEX` first"
        )
    return Calibration(**json.loads(path.read_text()))


def calibrate(
    adapter: ModelAdapter,
    work_dir: Path,
    codec: str,
    cache_dir: Path,
    n_tokens: int = 512,
    entries: int = 4,
    repeats: int = 3,
) -> Calibration:
    """Measure tier throughputs with `entries` synthetic caches of `n_tokens` tokens written under
    `work_dir` (use the disk the index lives on) and encoded by `codec`, and the prefill time; save and return
    them."""
    layout = adapter.layout
    g = torch.Generator().manual_seed(0)
    kv = ChunkKV(
        [
            torch.randn(layout.n_kv_heads, n_tokens, layout.head_dim, generator=g).to(layout.dtype)
            for _ in range(layout.n_layers)
        ],
        [
            torch.randn(layout.n_kv_heads, n_tokens, layout.head_dim, generator=g).to(layout.dtype)
            for _ in range(layout.n_layers)
        ],
        0,
    )  # L x [H_kv, T, D]
    store = KVStore(Path(work_dir) / ".calibration-store", codec, StorageConfig(memory_bytes=0))
    keys = [f"{i:032x}" for i in range(entries)]
    for key in keys:
        store.put(key, kv)
    stored = sum(store.path(k).stat().st_size for k in keys)

    def read_all(source_of) -> float:
        start = time.perf_counter()
        for key in keys:
            sources = [source_of(key)]
            for layer in range(layout.n_layers):
                pack_layer(sources, layer, adapter.device)  # what the fusion's reader does
        if adapter.device.type == "cuda":
            torch.cuda.synchronize(adapter.device)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {t: [] for t in MEASURED_TIERS}
    for _ in range(repeats):
        store.disk.drop_page_cache()
        seconds["disk"].append(read_all(store.disk.open))
        seconds["page_cache"].append(read_all(store.disk.open))
        seconds["memory"].append(read_all(lambda key: kv))
    throughput = {tier: stored / statistics.median(s) for tier, s in seconds.items()}  # stored bytes per second
    for key in keys:
        store.discard(key)

    ids = torch.randint(1000, 2000, (1, n_tokens), generator=g)  # [1, T]
    adapter.prefill(ids)  # warm-up
    prefill = statistics.median(time_prefill(adapter, ids) for _ in range(repeats))
    cal = Calibration(
        machine=machine_id(adapter.device),
        model_fingerprint=adapter.fingerprint,
        codec=codec,
        bytes_per_token_layer=stored / (entries * n_tokens * layout.n_layers),
        read_bytes_per_s=throughput,
        prefill_s_per_token_layer=prefill / (n_tokens * layout.n_layers),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    path = calibration_path(cache_dir, adapter, codec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=1))
    log.info("saved calibration to %s", path)
    return cal


def time_prefill(adapter: ModelAdapter, ids: torch.Tensor) -> float:
    """Seconds of one plain forward (`adapter.prefill`) over ids [1, T]."""
    start = time.perf_counter()
    adapter.prefill(ids)
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    return time.perf_counter() - start
