"""Plots of a benchmark result, PNG and SVG, drawn with matplotlib's Agg canvas.

No pyplot: figures are built on `matplotlib.figure.Figure` with an Agg
canvas, so drawing never changes the process-wide backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# One colour per mode, fixed, so a colour means the same mode in every plot;
# the transformers baselines are grey. With several model configs (arms
# `mode@config`) the config is told by a hatch (bars) or a line style.
ARM_COLOURS = {
    "plain": "#4d4d4d",
    "spec": "#1f77b4",
    "self-spec": "#2ca02c",
    "early-exit": "#d62728",
    "hf-generate": "#a6a6a6",
    "hf-assisted": "#7f9fbf",
}


HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")
LINESTYLES = ("-", "--", ":", "-.")


def _colour(arm: str) -> str:
    return ARM_COLOURS.get(arm.partition("@")[0], "#999")


def _config_index(data: dict[str, Any], arm: str) -> int:
    """Position of the arm's config in the run (0 for a one-config run)."""
    config = arm.partition("@")[2]
    labels = [c["label"] for c in data.get("configs") or []]
    return labels.index(config) if config in labels else 0


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out_dir: Path, name: str) -> list[Path]:
    paths = []
    for ext in ("png", "svg"):
        path = out_dir / f"{name}.{ext}"
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_tokens_per_s(data: dict[str, Any], out_dir: Path) -> list[Path]:
    summary = data["summary"]
    arms = [a for a in data["arms"] if summary[a]["tokens_per_s"]["median"] is not None]
    fig = _figure(width=max(7.0, 0.8 * len(arms)))
    ax = fig.add_subplot()
    if not arms:
        _empty(ax, "no completed runs")
        return _save(fig, out_dir, "tokens_per_s")
    # Earlier results have no reference: their labels are the ratios to plain.
    reference = data.get("reference")
    key = "speedup_vs_reference" if reference else "speedup_vs_plain"
    med = [summary[a]["tokens_per_s"]["median"] for a in arms]
    lo = [m - summary[a]["tokens_per_s"]["min"] for a, m in zip(arms, med, strict=True)]
    hi = [summary[a]["tokens_per_s"]["max"] - m for a, m in zip(arms, med, strict=True)]
    bars = ax.bar(
        arms,
        med,
        yerr=[lo, hi],
        capsize=4,
        color=[_colour(a) for a in arms],
        hatch=[HATCHES[_config_index(data, a) % len(HATCHES)] for a in arms],
        edgecolor="white",
    )
    for bar, a in zip(bars, arms, strict=True):
        s = (summary[a].get(key) or {}).get("median")
        if s is not None:  # above the whisker, so the label never crosses it
            top = summary[a]["tokens_per_s"]["max"]
            ax.annotate(
                f"{s:.2f}x",
                (bar.get_x() + bar.get_width() / 2, top),
                ha="center",
                va="bottom",
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax.margins(y=0.12)
    if len(arms) > 4 or any("@" in a for a in arms):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    unavailable = [a for a in data["arms"] if a not in arms]
    title = (
        f"Tokens/s by arm (median, min-max bars; label: speed vs {reference or 'plain'}, paired)"
    )
    ax.set_title(
        title + (f"\nnot measured: {', '.join(unavailable)}" if unavailable else ""), fontsize=9
    )
    ax.set_ylabel("tokens / s")
    return _save(fig, out_dir, "tokens_per_s")


def plot_acceptance(data: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for a in data["arms"]:
        acc = data["summary"][a].get("acceptance_by_position") or []
        points = [(i + 1, v) for i, v in enumerate(acc) if v is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            style = LINESTYLES[_config_index(data, a) % len(LINESTYLES)]
            ax.plot(xs, ys, marker="o", label=a, color=_colour(a), linestyle=style)
            drawn = True
    if not drawn:
        _empty(ax, "no speculative rounds")
    else:
        from matplotlib.ticker import MaxNLocator

        ax.set_ylim(-0.03, 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | earlier drafts accepted)")
        ax.legend()
    ax.set_title("Acceptance by draft position", fontsize=9)
    return _save(fig, out_dir, "acceptance_by_position")


def plot_latency(data: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = _figure(width=max(7.0, 0.8 * len(data["arms"])))
    ax = fig.add_subplot()
    series = {}
    for a in data["arms"]:
        vals = [
            v
            for r in data["runs"]
            if r["arm"] == a and r["status"] == "ok"
            for v in r["latencies_ms"]
        ]
        if vals:
            series[a] = vals
    if not series:
        _empty(ax, "no per-token latencies")
    else:
        parts = ax.boxplot(
            list(series.values()),
            tick_labels=list(series),
            showfliers=True,
            patch_artist=True,
            whis=(5, 95),
            medianprops={"color": "black"},
        )
        for patch, a in zip(parts["boxes"], series, strict=True):
            patch.set_facecolor(_colour(a))
            patch.set_hatch(HATCHES[_config_index(data, a) % len(HATCHES)])
            patch.set_alpha(0.6)
        if len(series) > 4 or any("@" in a for a in series):
            ax.tick_params(axis="x", labelrotation=30)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("ms per token (log scale)")
    ax.set_title(
        "Per-token latency after the first token (box: p25-p75, whiskers: p5-p95)", fontsize=9
    )
    return _save(fig, out_dir, "latency")


def plot_exit_layers(data: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for a in data["arms"]:
        s = data["summary"][a]
        hist = s.get("exit_layer_histogram") or {}
        if hist:
            layers = sorted(int(k) for k in hist)
            ax.bar(
                [x for x in layers],
                [hist[str(x)] for x in layers],
                label=a,
                alpha=0.7,
                color=_colour(a),
                hatch=HATCHES[_config_index(data, a) % len(HATCHES)],
            )
            drawn = True
    if not drawn:
        _empty(ax, "no early exits in this run")
    else:
        ax.set_xlabel("exit layer")
        ax.set_ylabel("tokens")
        ax.legend()
    ax.set_title("Early-exit layers", fontsize=9)
    return _save(fig, out_dir, "exit_layers")


def write_plots(data: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """All plots of `BenchResult.to_dict()` data into out_dir; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for plot in (plot_tokens_per_s, plot_acceptance, plot_latency, plot_exit_layers):
        paths += plot(data, out)
    return paths
