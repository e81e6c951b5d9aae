"""Benchmark reports: Markdown table, quality-vs-TTFT Pareto plot and JSON/Markdown/PNG bundle."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

Entry = Mapping[str, Any]

METRIC_KEYS = (
    "ttft_median_s", "ttft_p90_s", "speedup_vs_full", "f1_gold", "f1_vs_full",
    "first_token_agreement", "kl_vs_full", "recompute_fraction",
)
MISSING = "–"


def _check_entry(entry: Entry) -> None:
    missing = [key for key in ("method", "params", *METRIC_KEYS) if key not in entry]
    if missing:
        raise ValueError(f"summary entry is missing {missing}: {dict(entry)!r}")
    if not isinstance(entry["params"], Mapping):
        raise ValueError(f"summary entry 'params' must be a mapping, got {entry['params']!r}")


def _format_param(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _params_text(entry: Entry) -> str:
    return " ".join(f"{key}={_format_param(value)}" for key, value in entry["params"].items())


def label(entry: Entry) -> str:
    """Short name of a run, e.g. "full", "cacheblend r=0.15", "epic k=16"."""
    params = _params_text(entry)
    return f"{entry['method']} {params}" if params else str(entry["method"])


def _fmt(spec: str, suffix: str = "") -> Callable[[float | None], str]:
    return lambda value: MISSING if value is None else f"{value:{spec}}{suffix}"


def _fmt_sig3(value: float | None) -> str:
    """Three significant figures, keeping trailing zeros ("0.820") but not a bare point ("123.")."""
    return MISSING if value is None else f"{value:#.3g}".rstrip(".")


_COLUMNS: tuple[tuple[str, str, Callable[[float | None], str]], ...] = (
    ("ttft_median_s", "TTFT median (s)", _fmt_sig3),
    ("ttft_p90_s", "TTFT p90 (s)", _fmt_sig3),
    ("speedup_vs_full", "Speedup", _fmt(".1f", "x")),
    ("f1_gold", "F1 (gold)", _fmt(".3f")),
    ("f1_vs_full", "F1 vs full", _fmt(".3f")),
    ("first_token_agreement", "1st-token agree", _fmt(".3f")),
    ("kl_vs_full", "KL vs full", _fmt_sig3),
    ("recompute_fraction", "Recompute frac", _fmt(".3f")),
)


def markdown_table(summary: Sequence[Entry]) -> str:
    """GitHub Markdown table with one row per summary entry (missing metrics shown as "–")."""
    for entry in summary:
        _check_entry(entry)
    header = ["Method", *(title for _, title, _ in _COLUMNS)]
    rows = [[label(e), *(fmt(e[key]) for key, _, fmt in _COLUMNS)] for e in summary]
    lines = [header, ["---", *("---:" for _ in _COLUMNS)], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


STAGE_ORDER = ("kv_load", "kv_wait", "assemble_kv", "qkv", "attention", "mlp", "select", "logits", "prefill", "other")


def stage_table(summary: Sequence[Entry]) -> str:
    """Markdown table of median milliseconds per prefill stage (entries' `stage_median_s`), one row per entry.

    Stages are those of `Answer.stages` plus "other" (TTFT outside them: decoder setup, first sampling).
    """
    for entry in summary:
        _check_entry(entry)
        if not isinstance(entry.get("stage_median_s"), Mapping):
            raise ValueError(f"{label(entry)!r} has no 'stage_median_s' mapping: {dict(entry)!r}")
    seen = {name for e in summary for name in e["stage_median_s"]}
    stages = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    header = ["Method", "TTFT median (ms)", *(f"{s} (ms)" for s in stages)]
    rows = [
        [label(e), f"{e['ttft_median_s'] * 1000:.0f}",
         *(MISSING if s not in e["stage_median_s"] else f"{e['stage_median_s'][s] * 1000:.0f}" for s in stages)]
        for e in summary
    ]
    lines = [header, ["---", *("---:" for _ in header[1:])], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _plottable(summary: Sequence[Entry]) -> list[Entry]:
    points = []
    for entry in summary:
        _check_entry(entry)
        if entry["f1_vs_full"] is None or entry["ttft_median_s"] is None:
            logger.warning("not plotting %r: no f1_vs_full or ttft_median_s", label(entry))
            continue
        if entry["ttft_median_s"] <= 0:
            raise ValueError(f"{label(entry)!r}: ttft_median_s must be > 0 for a log axis, "
                             f"got {entry['ttft_median_s']}")
        points.append(entry)
    if not points:
        raise ValueError(f"nothing to plot: no entry has both ttft_median_s and f1_vs_full "
                         f"among {[label(e) for e in summary]}")
    return points


LABEL_OFFSETS = ((5, 5, "left"), (5, -11, "left"), (-5, 5, "right"), (-5, -11, "right"))  # points, points, ha


def _render_pareto(summary: Sequence[Entry]) -> bytes:
    from matplotlib.figure import Figure  # deferred: heavy import; Figure avoids pyplot global state
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points = _plottable(summary)
    ttfts = [e["ttft_median_s"] for e in points]
    panels = [("f1_vs_full", "F1 vs full-prefill answer", "linear", "up and left is better")]
    if any(e.get("kl_vs_full") is not None for e in points):
        panels.append(("kl_vs_full", "KL of first-token distribution from full", "symlog", "down and left is better"))
    fig = Figure(figsize=(8 * len(panels), 5.5), layout="constrained")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    methods = list(dict.fromkeys(e["method"] for e in points))  # one colour per method in both panels
    for ax, (key, ylabel, yscale, better) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for i, method in enumerate(methods):
            sweep = sorted((e for e in points if e["method"] == method and e.get(key) is not None),
                           key=lambda e: e["ttft_median_s"])
            if not sweep:
                continue
            x = [e["ttft_median_s"] for e in sweep]
            y = [e[key] for e in sweep]
            ax.plot(x, y, marker="o", color=f"C{i % 10}", label=method, linewidth=1.5, markersize=6)
            # The legend names the method, so a point carries only its parameter; each method's labels
            # sit on their own side of the point, so two methods' points close together stay readable.
            dx, dy, ha = LABEL_OFFSETS[i % len(LABEL_OFFSETS)]
            for entry, xy in zip(sweep, zip(x, y)):
                ax.annotate(_params_text(entry) or method, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8)
        ax.set_xscale("log")
        if yscale == "symlog":
            ax.set_yscale("symlog", linthresh=0.01)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5 s: readable ticks
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain if max(ttfts) / min(ttfts) < 10 else NullFormatter())
        ax.margins(x=0.12, y=0.06)
        ax.set_xlabel("median time to first token (s, log scale)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Quality vs latency ({better})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="method", loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    return buf.getvalue()


def plot_pareto(summary: Sequence[Entry], path: str | os.PathLike[str]) -> None:
    """PNG of answer quality against median TTFT (log x), one colour per method: F1 vs the full-prefill
    answer, and beside it the KL of the first-token distribution from full's for the entries that have it."""
    atomic_write(Path(path), _render_pareto(summary))
    logger.info("wrote %s", path)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__} {value!r}")


def _markdown(summary: Sequence[Entry], meta: Mapping[str, Any], plot_name: str) -> str:
    bullets = "".join(f"- **{key}**: {value}\n" for key, value in meta.items())
    stages = ""
    if summary and all("stage_median_s" in e for e in summary):
        stages = f"\nMedian time per prefill stage:\n\n{stage_table(summary)}"
    return f"# Benchmark results\n\n{bullets}\n{markdown_table(summary)}{stages}\n![pareto]({plot_name})\n"


def write_report(
    summary: Sequence[Entry],
    records: Sequence[Entry],
    out_dir: str | os.PathLike[str],
    meta: Mapping[str, Any],
) -> Path:
    """Write results.json, results.md and pareto.png into `out_dir`; returns `out_dir`.

    Everything is rendered before anything is written, and each file is replaced atomically.
    """
    out = Path(out_dir)
    payload = {"meta": dict(meta), "summary": list(summary), "records": list(records)}
    try:
        text = json.dumps(payload, indent=2, allow_nan=False, default=_json_default)
    except ValueError as err:
        raise ValueError(f"results for {out} contain NaN or inf, which JSON cannot hold: {err}") from err
    files = {
        "results.json": (text + "\n").encode("utf-8"),
        "results.md": _markdown(summary, meta, "pareto.png").encode("utf-8"),
        "pareto.png": _render_pareto(summary),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write(out / name, data)
    logger.info("wrote %s to %s", ", ".join(files), out)
    return out
