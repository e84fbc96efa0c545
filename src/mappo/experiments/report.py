"""Report tables over run directories: one row per configuration, statistics over its seeds.

Per configuration: the number of seeds and how many of them trained their whole budget (the
others failed, diverged or stopped early, with a warning), env steps and wall time (means over
seeds), the final and the best greedy evaluation (means over seeds), and the interquartile mean
of the final evaluations with a 95% percentile-bootstrap interval over seeds
(:mod:`mappo.experiments.stats`), beside the MAPPO paper's figure where the preset is one of the
paper's settings; with a target (``mappo report --target -120``), how many seeds reached it and
when, in env steps and in wall time (compilation included), judged by the mean of the last few
evaluations so that one lucky evaluation does not decide. Written as Markdown, CSV or JSON, and
exported in the JSON layout of marl-eval (Gorsane et al. 2022), which BenchMARL and Mava read.
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mappo import config as config_mod
from mappo.experiments.runs import (
    RETURN,
    WIN_RATE,
    Configuration,
    ResultsError,
    RunRecord,
    check_metric,
    default_metric,
    full_config,
    never_logs,
    not_evaluated,
    setting_items,
    with_values,
)
from mappo.experiments.stats import bootstrap

_PAPER_CODE = "the paper's code (marlbenchmark/on-policy at de66d7a), seed 1, on a 2-core CPU"
PAPER: dict[str, tuple[str, str]] = {
    # The final training return (team reward per agent, stochastic policy) of the MAPPO paper's
    # own code run with its own MPE scripts (rMAPPO, 128 envs x 25 steps). A training return,
    # not a greedy evaluation: it is the closest figure to the preset that could be checked.
    "mpe/simple_spread": ("-117.3 training return at 4.58M of 20M steps", _PAPER_CODE),
    "mpe/simple_speaker_listener": ("-10.1 training return at 1.99M steps", _PAPER_CODE),
    "mpe/simple_reference": ("-9.3 training return at 3.0M steps", _PAPER_CODE),
}
"""Preset -> (a reference figure for it, where it comes from), for presets with the MAPPO
paper's settings (Yu et al. 2022, arXiv 2103.01955)."""


@dataclass
class ReportRow:
    """One configuration's line of a report."""

    configuration: str
    task: str
    algo: str
    metric: str
    seeds: int
    """Seeds with values of the metric, which the figures are over."""
    env_steps: float
    wall_seconds: float
    final_mean: float
    best_mean: float
    final_iqm: float
    final_iqm_low: float
    final_iqm_high: float
    paper: str
    paper_source: str
    target: float = math.nan
    """The level asked for (``nan``: none)."""
    target_window: int | None = None
    """How many consecutive evaluations the level is judged on (their mean; ``None``: no
    target)."""
    reached: int | None = None
    """Seeds whose mean of ``target_window`` consecutive evaluations reached ``target``
    (``None``: no target)."""
    target_steps: float = math.nan
    """Env steps at the first such evaluation: the median over the seeds that reached it."""
    target_seconds: float = math.nan
    """Wall seconds since the run started (compilation included) at that evaluation: median."""
    target_seconds_max: float = math.nan
    """The same, the slowest seed that reached it."""
    # (after the fields of earlier versions, so that a CSV's columns keep their places)
    trained: int = 0
    """Every seed of the configuration found, with values of the metric or not (a seed that
    failed before its first evaluation has none)."""
    complete: int = 0
    """Seeds that trained their whole budget (:attr:`RunRecord.complete`); the others' figures
    are from where they stopped."""
    failed: int = 0
    """Seeds whose folder holds a sweep's ``error.txt`` (``diverged`` included)."""
    diverged: int = 0
    """Seeds that failed with ``TrainingDiverged``."""


def first_reach(
    steps: np.ndarray, seconds: np.ndarray, values: np.ndarray, target: float, window: int
) -> tuple[float, float] | None:
    """``(env steps, wall seconds)`` at the first evaluation where the mean of it and the
    ``window - 1`` evaluations before it is at least ``target``; ``None`` if that never happens.
    The arrays are one run's evaluations in order, ``[k]`` each."""
    if window < 1:
        raise ValueError("the window must be at least one evaluation")
    if len(values) < window:
        return None
    sums = np.convolve(values, np.ones(window), mode="valid")  # [k - window + 1]
    # the mean equal to the level counts, whatever the last bit of the sum's rounding
    hits = np.flatnonzero(sums / window >= target - 1e-9 * max(1.0, abs(target)))
    if not len(hits):
        return None
    i = int(hits[0]) + window - 1
    return float(steps[i]), float(seconds[i])


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _has_preset_settings(config: dict[str, Any], preset: str) -> bool:
    """Whether a run's flat ``config`` has ``preset``'s settings, apart from bookkeeping keys
    (seed, budget, intervals): where the paper's figure for the preset applies."""
    own = full_config(config_mod.to_dict(config_mod.load(preset)))
    return setting_items(config) == setting_items(own)


def report_rows(
    configs: list[Configuration],
    metric: str | None = None,
    seed: int = 0,
    target: float | None = None,
    window: int = 3,
) -> list[ReportRow]:
    """The report's rows over the runs that logged ``metric`` (default: each configuration's
    win rate if it logs one, else its greedy return); the bootstrap uses ``seed`` (so a report
    is reproducible). With ``target``, each row also says when its seeds first reached it
    (:func:`first_reach` over ``window`` evaluations)."""
    if window < 1:
        raise ResultsError(f"--window must be at least 1 evaluation, not {window}")
    if metric is not None:
        metric = check_metric([r for c in configs for r in c.runs], metric)
    # Each configuration's default: its task's (a configuration that has not evaluated yet
    # logs no win rate so far, which its map's other configurations show it will).
    by_task: dict[str, list[RunRecord]] = {}
    for c in configs:
        by_task.setdefault(c.task, []).extend(c.runs)
    names = [metric or default_metric(by_task[c.task]) for c in configs]
    if metric is None and target is not None:
        defaults = sorted(set(names))
        if len(defaults) > 1:  # (a level of -120 is a return's; every win rate would miss it)
            raise ResultsError(
                f"--target is a level of one metric, but the configurations report "
                f"{' and '.join(defaults)}; pass --metric"
            )
    rows = []
    for conf, name in zip(configs, names, strict=True):
        if never_logs(conf.runs, name):
            # Another kind of run (a row of no seeds would say nothing); runs that have not
            # evaluated yet keep a row of no seeds.
            warnings.warn(f"'{conf.label}' does not log '{name}'; left out", stacklevel=2)
            continue
        runs = with_values(conf, name)
        finals, bests, reached, ends = [], [], [], []
        for run in runs:
            steps, y = run.curve(name)
            ends.append(int(steps[-1]))
            finals.append(float(y[-1]))
            bests.append(float(y.max()))
            hit = None if target is None else _reach(run, name, target, window)
            if hit is not None:
                reached.append(hit)
        # (over every seed: one that failed before its first evaluation has no values)
        complete = sum(run.complete for run in conf.runs)
        if complete < len(conf.runs):
            warnings.warn(
                f"'{conf.label}': {len(conf.runs) - complete} of {len(conf.runs)} seeds are "
                f"incomplete ({_shortfall(conf.runs)}); the row's figures are from where they "
                "stopped",
                stacklevel=2,
            )
        elif ends and max(ends) - min(ends) > max(run.iteration_steps for run in runs):
            # Complete seeds of different budgets (total_env_steps is bookkeeping): the earlier
            # ones' last evaluation is an earlier one (a plot cuts to the shared range). Seeds of
            # one budget end less than one iteration apart, not on one step: a run stops at the
            # first iteration that reaches its budget, and evaluates there, and the value
            # family's iterations are whole episodes, whose lengths vary from seed to seed.
            warnings.warn(
                f"the seeds of '{conf.label}' last evaluated '{name}' at different env steps "
                f"({min(ends):,} to {max(ends):,}); their final values are averaged as they are",
                stacklevel=2,
            )
        interval = bootstrap(finals, "iqm", seed=seed) if finals else None
        preset = str(conf.runs[0].config.get("preset") or "")
        paper, source = PAPER.get(preset, ("", ""))
        if paper and not _has_preset_settings(conf.runs[0].config, preset):
            paper = source = ""  # (algo.name=qmix over the paper's preset is not its settings)
        rows.append(
            ReportRow(
                configuration=conf.label,
                task=conf.task,
                algo=conf.runs[0].algo,
                metric=name,
                seeds=len(runs),
                trained=len(conf.runs),
                complete=complete,
                failed=sum(run.failed for run in conf.runs),
                diverged=sum(run.diverged for run in conf.runs),
                env_steps=_mean([run.final("env_steps") for run in runs]),
                wall_seconds=_mean([run.final("wall_seconds") for run in runs]),
                final_mean=_mean(finals),
                best_mean=_mean(bests),
                final_iqm=interval.value if interval else math.nan,
                final_iqm_low=interval.low if interval else math.nan,
                final_iqm_high=interval.high if interval else math.nan,
                paper=paper,
                paper_source=source,
                target=math.nan if target is None else float(target),
                target_window=window if target is not None else None,
                reached=len(reached) if target is not None else None,
                target_steps=_median([s for s, _ in reached]),
                target_seconds=_median([t for _, t in reached]),
                target_seconds_max=max((t for _, t in reached), default=math.nan),
            )
        )
    if rows and not any(row.seeds for row in rows) and not any(row.failed for row in rows):
        # (seeds that failed before any evaluation are a row's news, not an early report)
        raise not_evaluated(metric or default_metric([r for c in configs for r in c.runs]))
    return rows


def _failures(failed: int, diverged: int) -> str:
    """``2 diverged, 1 failed`` (empty when both are zero)."""
    parts = [f"{diverged} diverged"] if diverged else []
    return ", ".join(parts + ([f"{failed - diverged} failed"] if failed > diverged else []))


def _shortfall(runs: list[RunRecord]) -> str:
    """Why ``runs`` are not complete, in words: the failures, then the seeds that stopped."""
    failed = [run for run in runs if run.failed]
    short = sum(not run.complete and not run.failed for run in runs)
    parts = []
    if failed:
        text = _failures(len(failed), sum(run.diverged for run in failed))
        folders = ", ".join(f"'{run.dir}'" for run in failed)
        parts.append(f"{text}: see error.txt in {folders}")
    if short:
        parts.append(f"{short} stopped before total_env_steps or still training")
    return "; ".join(parts)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _reach(run: RunRecord, metric: str, target: float, window: int) -> tuple[float, float] | None:
    """:func:`first_reach` over ``run``'s evaluations of ``metric``."""
    for column in ("env_steps", "wall_seconds"):
        if column not in run.columns:
            raise ResultsError(
                f"'{run.dir / 'metrics.csv'}' has no column '{column}', which --target needs"
            )
    c = run.columns
    keep = np.isfinite(c[metric]) & np.isfinite(c["env_steps"]) & np.isfinite(c["wall_seconds"])
    steps, seconds, values = c["env_steps"][keep], c["wall_seconds"][keep], c[metric][keep]
    if len(values) < window:  # else a short run would read as one that missed the level
        warnings.warn(
            f"'{run.dir}' has {len(values)} evaluation(s), fewer than --window={window}, so it "
            "cannot count as reaching the target; train it longer or lower --window",
            stacklevel=3,
        )
    return first_reach(steps, seconds, values, target, window)


def _num(value: float, digits: int = 2) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.{digits}f}"


def _steps(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    # short runs (a smoke test's 500 steps read "0k" when rounded to thousands)
    return f"{value / 1e3:.3g}k" if value >= 1e3 else f"{value:.0f}"


def format_markdown(rows: list[ReportRow]) -> str:
    """A Markdown table with the metric named above it."""
    metrics = sorted({r.metric for r in rows})
    targeted = [r for r in rows if math.isfinite(r.target)]
    names = ["configuration"] + ["metric"] * (len(metrics) > 1)  # (each task's default)
    names += ["seeds", "complete", "env steps", "wall", "final (mean)", "best (mean)"]
    names += ["final IQM [95% CI]"]
    if targeted:
        t = targeted[0]
        names += [
            f"reached {t.target:g} (mean of {t.target_window})",
            "env steps to it (median)",
            "wall to it (median, slowest)",
        ]
    names += ["paper code"]
    head = f"| {' | '.join(names)} |\n|{'---|' * len(names)}\n"
    lines = []
    for r in rows:
        paper = f"{r.paper} ({r.paper_source})" if r.paper else ""
        cells = [r.configuration] + [r.metric] * (len(metrics) > 1)
        cells += [
            str(r.seeds),
            f"{r.complete} / {r.trained}"
            + (f" ({_failures(r.failed, r.diverged)})" if r.failed else ""),
            _steps(r.env_steps),
            f"{_num(r.wall_seconds, 0)} s" if math.isfinite(r.wall_seconds) else "-",
            _num(r.final_mean),
            _num(r.best_mean),
            f"{_num(r.final_iqm)} [{_num(r.final_iqm_low)}, {_num(r.final_iqm_high)}]",
        ]
        if targeted:
            cells += [
                f"{r.reached} / {r.trained}",  # (a seed that failed has not reached it)
                _steps(r.target_steps),
                f"{_num(r.target_seconds, 0)} s, {_num(r.target_seconds_max, 0)} s"
                if r.reached
                else "-",
            ]
        lines.append(f"| {' | '.join([*cells, paper])} |")
    evaluated = all(m.startswith("eval/") for m in metrics)
    what = " (greedy evaluation)" if evaluated else ""
    return f"Metric: `{'`, `'.join(metrics)}`{what}\n\n" + head + "\n".join(lines)


def format_csv(rows: list[ReportRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(asdict(rows[0])) if rows else [])
    writer.writeheader()
    writer.writerows(asdict(r) for r in rows)
    return out.getvalue()


def format_json(rows: list[ReportRow]) -> str:
    """The rows as a JSON list, ``null`` where a figure does not exist (``NaN`` is not JSON)."""
    clean = [
        {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(r).items()}
        for r in rows
    ]
    return json.dumps(clean, indent=2)


FORMATS = {"markdown": format_markdown, "csv": format_csv, "json": format_json}


def marl_eval(configs: list[Configuration], metric: str | None = None) -> dict[str, Any]:
    """The runs in marl-eval's raw-data layout:
    ``{env: {task: {algorithm: {run: {"step_i": {"step_count", metric: [...]},
    "absolute_metrics": {metric: [...]}}}}}}``.

    ``env``/``task`` split the env name at its first ``/`` (``smac``/``3m``); the algorithm is
    the configuration's label; runs are ``seed_<k>``. mappo logs the mean of each evaluation,
    not its episodes, so every list holds that one mean; the metric is ``win_rate`` for battle
    wins, ``return`` for the return, and any other metric under its own name without the
    ``eval/eval_`` prefix (``eval_hits`` as ``hits``: marl-eval's readers treat ``return`` as a
    return). ``absolute_metrics`` is the final evaluation.
    """
    if metric is not None:
        metric = check_metric([r for c in configs for r in c.runs], metric)
    out: dict[str, Any] = {}
    for conf in configs:
        column = metric or default_metric(conf.runs)
        name = {WIN_RATE: "win_rate", RETURN: "return"}.get(column)
        name = name or column.split("/")[-1].removeprefix("eval_")
        env, _, task = conf.task.partition("/")
        algo = out.setdefault(env, {}).setdefault(task or env, {}).setdefault(conf.label, {})
        for run in with_values(conf, column):
            algo[f"seed_{run.seed}"] = _marl_eval_run(run, column, name)  # one run per seed
    return out


def _marl_eval_run(run: RunRecord, metric: str, name: str) -> dict[str, Any]:
    steps, values = run.curve(metric)
    record: dict[str, Any] = {
        f"step_{i}": {"step_count": int(s), name: [float(v)]}
        for i, (s, v) in enumerate(zip(steps, values, strict=True))
    }
    record["absolute_metrics"] = {name: [float(values[-1])] if values.size else []}
    return record
