"""Statistics over seeds: the interquartile mean and percentile-bootstrap confidence intervals.

Agarwal et al. 2021 ("Deep Reinforcement Learning at the Edge of the Statistical Precipice")
recommend the interquartile mean (IQM) with bootstrap intervals over a few seeds; the MARL
evaluation protocol of Gorsane et al. 2022 (marl-eval) adopts them. Every function here is a pure
function of its inputs and of ``seed``, so a report is reproducible and testable by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

BOOTSTRAP_SAMPLES = 2000
"""Resamples per interval: enough for a stable 95% interval over a handful of seeds."""


class Interval(NamedTuple):
    """A point estimate and its confidence interval."""

    value: float
    low: float
    high: float


def iqm(values: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean along ``axis``: the mean of the sorted values after dropping
    ``floor(n / 4)`` from each end (as ``scipy.stats.trim_mean(x, 0.25)``). With fewer than
    four values nothing is dropped and it is the mean."""
    x = np.sort(np.asarray(values, dtype=np.float64), axis=axis)
    n = x.shape[axis]
    k = n // 4
    return np.take(x, np.arange(k, n - k), axis=axis).mean(axis=axis)


def _mean(values: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).mean(axis=axis)


STATISTICS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {"mean": _mean, "iqm": iqm}


def bootstrap(
    values: np.ndarray,
    statistic: str = "iqm",
    confidence: float = 0.95,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
) -> Interval:
    """``statistic`` of ``values`` ``[n]`` (one per seed) with a percentile-bootstrap interval.

    The resamples are ``numpy.random.default_rng(seed).integers(0, n, size=(samples, n))``:
    ``samples`` draws of ``n`` seeds with replacement; the interval is the ``(1 - confidence) / 2``
    and ``(1 + confidence) / 2`` quantiles (numpy's default linear interpolation) of the
    statistic over the resamples. One value gives a zero-width interval.
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("bootstrap needs at least one value")
    stat = STATISTICS[statistic]
    idx = np.random.default_rng(seed).integers(0, x.size, size=(samples, x.size))
    resampled = stat(x[idx], -1)  # [samples]
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(resampled, [tail, 1.0 - tail])
    return Interval(float(stat(x, -1)), float(low), float(high))


def bootstrap_curves(
    curves: np.ndarray,
    confidence: float = 0.95,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds of ``curves`` ``[n_seeds, n_points]`` and its bootstrap interval at every
    point, resampling whole seeds (one index set per resample for all points, so a band follows
    seeds, not points). Returns ``(mean, low, high)``, each ``[n_points]``."""
    y = np.asarray(curves, dtype=np.float64)
    n = y.shape[0]
    idx = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    means = y[idx].mean(axis=1)  # [samples, n_points]
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail], axis=0)
    return y.mean(axis=0), low, high
