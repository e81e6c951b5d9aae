"""Benchmark reports: Markdown table, fidelity-vs-TTFT Pareto plot and JSON/Markdown/PNG bundle."""

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
    "ttft_median_s",
    "speedup_vs_full",
    "compute_fraction",
    "tf_kl",
    "tf_top1",
    "tf_logp_delta",
    "first_token_kl",
    "f1_gold",
    "f1_vs_full",
)
MISSING = "–"


def _check_entry(entry: Entry) -> None:
    """A variant's entry carries every metric; the noise-floor entry only the fidelity ones."""
    keys = ("tf_kl", "tf_top1", "tf_logp_delta", "first_token_kl") if entry.get("noise_floor") else METRIC_KEYS
    missing = [key for key in ("method", "params", *keys) if key not in entry]
    if missing:
        raise ValueError(f"summary entry is missing {missing}: {dict(entry)!r}")
    if not isinstance(entry["params"], Mapping):
        raise ValueError(f"summary entry 'params' must be a mapping, got {entry['params']!r}")


def _format_param(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _params_text(entry: Entry) -> str:
    return " ".join(f"{key}={_format_param(value)}" for key, value in entry["params"].items())


def series(entry: Entry) -> str:
    """A method and the chunk caches it ran on: "reuse", or "reuse@neighbours" for the caches of an index
    built with another `chunk_prefill` than the run's."""
    caches = entry.get("caches")
    return f"{entry['method']}@{caches}" if caches else str(entry["method"])


def label(entry: Entry) -> str:
    """Short name of a run, e.g. "full", "cacheblend r=0.15", "epic k=16", "full kv=bfloat16",
    "cacheblend@neighbours r=0.15" (the one place labels are made: `Variant.label` uses it too)."""
    params = _params_text(entry)
    return f"{series(entry)} {params}" if params else series(entry)


def _fmt(spec: str, suffix: str = "") -> Callable[[float | None], str]:
    return lambda value: MISSING if value is None else f"{value:{spec}}{suffix}"


def _fmt_sig3(value: float | None) -> str:
    """Three significant figures, keeping trailing zeros ("0.820") but not a bare point ("123.")."""
    return MISSING if value is None else f"{value:#.3g}".rstrip(".")


def _with_ci(fmt: Callable[[float | None], str]) -> Callable[[Entry, str], str]:
    """A cell "mean [low, high]" from the entry's `key` and `key_ci`."""

    def cell(entry: Entry, key: str) -> str:
        ci = entry.get(f"{key}_ci")
        return fmt(entry.get(key)) + ("" if ci is None else f" [{fmt(ci[0])}, {fmt(ci[1])}]")

    return cell


def _plain(fmt: Callable[[float | None], str]) -> Callable[[Entry, str], str]:
    return lambda entry, key: fmt(entry.get(key))


_fmt_signed = _fmt("+.3g")
# (key, title, cell); fidelity first (teacher-forced over full's greedy answer), F1 last (secondary).
_COLUMNS: tuple[tuple[str, str, Callable[[Entry, str], str]], ...] = (
    ("ttft_median_s", "TTFT median (s)", _plain(_fmt_sig3)),
    ("speedup_vs_full", "Speedup", _plain(_fmt(".1f", "x"))),
    ("compute_fraction", "Compute frac", _plain(_fmt(".3f"))),
    ("chunk_tokens_matched", "Chunk tokens matched", _plain(_fmt(".3f"))),
    ("tf_kl", "TF KL [95% CI]", _with_ci(_fmt_sig3)),
    ("tf_kl_diff", "TF KL - baseline [95% CI]", _with_ci(_fmt_signed)),
    ("tf_top1", "TF top-1", _with_ci(_fmt(".3f"))),
    ("tf_logp_delta", "TF Δ log p", _with_ci(_fmt_signed)),
    ("first_token_kl", "1st-token KL", _with_ci(_fmt_sig3)),
    ("planted_accuracy", "Planted acc", _with_ci(_fmt(".2f"))),
    ("planted_accuracy_first", "Planted acc: fact first", _with_ci(_fmt(".2f"))),
    ("planted_accuracy_later", "Planted acc: fact later", _with_ci(_fmt(".2f"))),
    ("planted_distractor", "Planted: distractor", _with_ci(_fmt(".2f"))),
    ("f1_gold", "F1 (gold)", _plain(_fmt(".3f"))),
    ("f1_vs_full", "F1 vs full", _plain(_fmt(".3f"))),
)


_OPTIONAL = (  # shown only when an entry has them
    "chunk_tokens_matched",
    "planted_accuracy",
    "planted_accuracy_first",
    "planted_accuracy_later",
    "planted_distractor",
)


def markdown_table(summary: Sequence[Entry]) -> str:
    """GitHub Markdown table with one row per summary entry (missing metrics shown as "–"); the chunk
    tokens matched and planted accuracy columns only when an entry has them."""
    for entry in summary:
        _check_entry(entry)
    columns = [c for c in _COLUMNS if c[0] not in _OPTIONAL or any(c[0] in e for e in summary)]
    header = ["Method", *(title for _, title, _ in columns)]
    rows = [[label(e), *(cell(e, key) for key, _, cell in columns)] for e in summary]
    lines = [header, ["---", *("---:" for _ in columns)], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


STAGE_ORDER = (
    "match",
    "kv_load",
    "layout",
    "setup",
    "kv_wait",
    "qkv",
    "attention",
    "mlp",
    "select",
    "layers",
    "logits",
    "prefill",
    "other",
)


def stage_table(summary: Sequence[Entry]) -> str:
    """Markdown table of median milliseconds per prefill stage (entries' `stage_median_s`), one row per entry.

    Stages are those of `Answer.stages` plus "other" (TTFT outside them: decoder setup, first sampling).
    "TTFT / share of full's" is each entry's `ttft_over_share` (the median over questions of its TTFT over
    its compute fraction times full's; "–" where a summary has none).
    """
    summary = [e for e in summary if not e.get("noise_floor")]
    for entry in summary:
        _check_entry(entry)
        if not isinstance(entry.get("stage_median_s"), Mapping):
            raise ValueError(f"{label(entry)!r} has no 'stage_median_s' mapping: {dict(entry)!r}")
    seen = {name for e in summary for name in e["stage_median_s"]}
    stages = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    header = ["Method", "TTFT median (ms)", "TTFT / share of full's", *(f"{s} (ms)" for s in stages)]
    rows = [
        [
            label(e),
            f"{e['ttft_median_s'] * 1000:.0f}",
            _fmt(".3f")(e.get("ttft_over_share")),
            *(MISSING if s not in e["stage_median_s"] else f"{e['stage_median_s'][s] * 1000:.0f}" for s in stages),
        ]
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
        if entry.get("noise_floor"):
            continue
        if entry["tf_kl"] is None or entry["ttft_median_s"] is None:
            logger.warning("not plotting %r: no tf_kl or ttft_median_s", label(entry))
            continue
        if entry["ttft_median_s"] <= 0:
            raise ValueError(
                f"{label(entry)!r}: ttft_median_s must be > 0 for a log axis, got {entry['ttft_median_s']}"
            )
        points.append(entry)
    if not points:
        raise ValueError(
            f"nothing to plot: no entry has both ttft_median_s and tf_kl among {[label(e) for e in summary]}"
        )
    return points


LABEL_OFFSETS = ((5, 5, "left"), (5, -11, "left"), (-5, 5, "right"), (-5, -11, "right"))  # points, points, ha
KL_LINTHRESH = 1e-6  # symlog: exact methods (KL 0) stay on the axis, the rest is log-scaled


def render_pareto(summary: Sequence[Entry]) -> bytes:
    """PNG of fidelity against median TTFT (log x), one colour per method: the teacher-forced KL from
    full (symlog y, the bfloat16 noise floor as a dashed line), and beside it the planted-fact accuracy
    when the entries have it. Entries without a fidelity are left out (logged); none left, or a TTFT
    not above 0, is a ValueError."""
    from matplotlib.figure import Figure  # deferred: heavy import; Figure avoids pyplot global state
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points = _plottable(summary)
    floor = next((e for e in summary if e.get("noise_floor") and e.get("tf_kl") is not None), None)
    ttfts = [e["ttft_median_s"] for e in points]
    panels = [("tf_kl", "teacher-forced KL per token from full (nats, log)", "symlog", "down and left is better")]
    if any(e.get("planted_accuracy") is not None for e in points):
        panels.append(
            ("planted_accuracy", "planted-fact accuracy (of the facts full answers)", "linear", "up and left is better")
        )
    fig = Figure(figsize=(8 * len(panels), 5.5), layout="constrained")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    methods = list(dict.fromkeys(series(e) for e in points))  # one colour per method (and caches) in every panel
    for ax, (key, ylabel, yscale, better) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for i, method in enumerate(methods):
            sweep = sorted(
                (e for e in points if series(e) == method and e.get(key) is not None), key=lambda e: e["ttft_median_s"]
            )
            if not sweep:
                continue
            x = [e["ttft_median_s"] for e in sweep]
            y = [e[key] for e in sweep]
            ax.plot(x, y, marker="o", color=f"C{i % 10}", label=method, linewidth=1.5, markersize=6)
            # The legend names the method, so a point carries only its parameter; each method's labels
            # sit on their own side of the point, so two methods' points close together stay readable.
            dx, dy, ha = LABEL_OFFSETS[i % len(LABEL_OFFSETS)]
            for entry, xy in zip(sweep, zip(x, y)):
                ax.annotate(
                    _params_text(entry) or method, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8
                )
        ax.set_xscale("log")
        if yscale == "symlog":
            ax.set_yscale("symlog", linthresh=KL_LINTHRESH)
            if floor is not None:
                ax.axhline(
                    floor["tf_kl"], color="grey", linestyle="--", linewidth=1, label=f"noise floor ({label(floor)})"
                )
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5 s: readable ticks
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain if max(ttfts) / min(ttfts) < 10 else NullFormatter())
        ax.margins(x=0.12, y=0.06)
        ax.set_xlabel("median time to first token (s, log scale)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Fidelity vs latency ({better})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="method", loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    return buf.getvalue()


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
        "pareto.png": render_pareto(summary),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write(out / name, data)
    logger.info("wrote %s to %s", ", ".join(files), out)
    return out
