"""Learning curves of many runs: one line (the mean over seeds) and one band (its 95% bootstrap
interval) per configuration, against env steps or wall time (matplotlib, ``mappo[plot]``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from mappo.experiments.runs import (
    Configuration,
    ResultsError,
    RunRecord,
    check_metric,
    default_metric,
    never_logs,
    with_values,
)
from mappo.experiments.stats import bootstrap_curves

X_AXES = {"env_steps": "env steps", "wall_seconds": "wall time (s)"}


def aggregate(
    conf: Configuration, metric: str, x: str = "env_steps", points: int = 100, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A configuration's seeds on a common grid: ``(grid, mean, low, high)``, each ``[points]``.

    Each seed's curve is linearly interpolated onto ``points`` values of ``x`` spanning the range
    every seed covers (from the latest first point to the earliest last point), so the band at a
    point always averages all seeds; a seed that stopped early shortens the curve.
    """
    curves = [run.curve(metric, x) for run in with_values(conf, metric, x)]
    if not curves:
        raise ResultsError(f"'{conf.label}' has no '{metric}' values yet")
    start = max(float(cx[0]) for cx, _ in curves)
    stop = min(float(cx[-1]) for cx, _ in curves)
    grid = np.linspace(start, stop, points if stop > start else 1)
    ys = np.stack([np.interp(grid, cx, cy) for cx, cy in curves])  # [seeds, points]
    mean, low, high = bootstrap_curves(ys, seed=seed)
    return grid, mean, low, high


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ResultsError(
            "plots need matplotlib: pip install 'mappo[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed (headless machines, CI)
    import matplotlib.pyplot as plt

    return plt


def plot_curves(
    configs: list[Configuration],
    metric: str | None = None,
    x: str = "env_steps",
    out: str | Path | None = None,
    title: str | None = None,
) -> Any:
    """A figure with one line and one band per configuration, one panel per task (a sweep of
    several scenarios has returns on different scales: Spread's -110 would flatten Comm's -12);
    saved to ``out`` when given (the format follows its suffix: .png, .pdf, .svg). Without a
    ``metric`` each panel draws its task's default (:func:`default_metric`: the win rate where
    its runs log one, else the greedy return), as a report does per configuration. Returns the
    matplotlib Figure; its axes follow the tasks in the order of ``configs``, each with its
    metric as its y label."""
    if x not in X_AXES:
        raise ResultsError(f"--x must be one of {list(X_AXES)}, got {x!r}")
    every = [r for c in configs for r in c.runs]
    if metric is not None:
        metric = check_metric(every, metric)
    else:  # (runs of which none has evaluated are one error, not a warning per configuration)
        check_metric(every, default_metric(every))
    tasks: dict[str, list[RunRecord]] = {}
    for conf in configs:
        tasks.setdefault(conf.task, []).extend(conf.runs)
    names = {task: metric or default_metric(runs) for task, runs in tasks.items()}
    panels: dict[str, list[tuple[Configuration, tuple[np.ndarray, ...]]]] = {}
    for conf in configs:
        name = names[conf.task]
        if never_logs(conf.runs, name):
            warnings.warn(f"'{conf.label}' does not log '{name}'; left out", stacklevel=2)
            continue
        try:
            series = aggregate(conf, name, x)
        except ResultsError:  # no seed of it has evaluated yet (with_values warned of them)
            continue
        panels.setdefault(conf.task, []).append((conf, series))
    plt = _pyplot()
    n = max(1, len(panels))
    cols = min(n, 3)
    rows = -(-n // cols)
    size = (7.0, 4.5) if n == 1 else (5.2 * cols, 4.0 * rows)
    fig, grid_axes = plt.subplots(rows, cols, figsize=size, dpi=120, squeeze=False)
    axes = list(grid_axes.flat)
    for ax in axes[max(1, len(panels)) :]:  # unused cells (an empty figure keeps one)
        ax.remove()
    for ax, (task, members) in zip(axes, panels.items(), strict=False):
        for conf, (grid, mean, low, high) in members:
            # (a marker where a configuration has a single point: a line of one point is not
            # drawn, and its seeds' spread is an error bar instead of a band)
            single = len(grid) == 1
            count = len(conf.runs)
            label = f"{conf.label} ({count} seed{'s' if count != 1 else ''})"
            (line,) = ax.plot(grid, mean, label=label, marker="o" if single else None)
            if single:
                ax.errorbar(grid, mean, yerr=[mean - low, high - mean], color=line.get_color())
            else:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(names[task])
        ax.set_title(task if n > 1 else (title or task))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if not panels:
        axes[0].set_title(title or ", ".join(sorted({c.task for c in configs})))
    elif n > 1 and title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out)
    return fig
