"""PNG charts of bench results (matplotlib, headless Agg backend).

matplotlib is imported only when a chart is asked for, so `kiln bench` without `--plot`
works on an install without it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from kiln.bench.stats import percentile


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kiln-llm[bench]' "
                         "(or drop --plot)") from None
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    return plt


def distributions(samples: dict[str, Sequence[float]], title: str, path: Path) -> Path:
    """One histogram per named distribution, with p50 / p90 / p99 marked."""
    plt = _pyplot()
    names = [n for n, v in samples.items() if len(v) > 0]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.2 * max(1, len(names)), 3.4),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        values = list(samples[name])
        ax.hist(values, bins=min(40, max(5, len(values) // 3)), color="#4a7ab5", alpha=0.85)
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            ax.axvline(percentile(values, q), color="#c0392b", linestyle=style,
                       label=f"p{q} {percentile(values, q):.3g}")
        ax.set_xlabel(name)
        ax.set_ylabel("count")
        ax.legend(fontsize=7)
    if not names:
        axes[0][0].text(0.5, 0.5, "no samples", ha="center", va="center")
    fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)


def bars(groups: dict[str, dict[str, float]], title: str, ylabel: str, path: Path,
         log: bool = False) -> Path:
    """Grouped bars: one group per key of `groups`, one bar per series inside it."""
    plt = _pyplot()
    series = sorted({s for g in groups.values() for s in g})
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(groups) * max(1, len(series)) + 2), 4.0))
    for i, name in enumerate(series):
        xs = [j + i * width for j in range(len(groups))]
        ys = [g.get(name, 0.0) or 0.0 for g in groups.values()]
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels(list(groups), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    return _save(fig, plt, path)


def line(xs: Sequence[float], series: dict[str, Sequence[float]], title: str, xlabel: str,
         ylabel: str, path: Path) -> Path:
    """One line per named series over the same x values."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for name, ys in series.items():
        ax.plot(list(xs), list(ys), label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
