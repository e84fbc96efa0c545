"""Report tables over run directories: one row per configuration, statistics over its seeds.

Per configuration: the number of seeds, env steps and wall time (means over seeds), the final and
the best greedy evaluation (means over seeds), and the interquartile mean of the final
evaluations with a 95% percentile-bootstrap interval over seeds (:mod:`mappo.experiments.stats`),
beside the MAPPO paper's figure where the preset is one of the paper's settings. Written as
Markdown, CSV or JSON, and exported in the JSON layout of marl-eval (Gorsane et al. 2022), which
BenchMARL and Mava read.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from mappo.experiments.runs import (
    WIN_RATE,
    Configuration,
    RunRecord,
    check_metric,
    default_metric,
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
    env_steps: float
    wall_seconds: float
    final_mean: float
    best_mean: float
    final_iqm: float
    final_iqm_low: float
    final_iqm_high: float
    paper: str
    paper_source: str


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def report_rows(
    configs: list[Configuration], metric: str | None = None, seed: int = 0
) -> list[ReportRow]:
    """The report's rows over the runs that logged ``metric`` (default: each configuration's
    win rate if it logs one, else its greedy return); the bootstrap uses ``seed`` (so a report
    is reproducible)."""
    if metric is not None:
        check_metric([r for c in configs for r in c.runs], metric)
    rows = []
    for conf in configs:
        name = metric or default_metric(conf.runs)
        runs = with_values(conf, name)
        finals, bests = [], []
        for run in runs:
            _, y = run.curve(name)
            finals.append(float(y[-1]))
            bests.append(float(y.max()))
        interval = bootstrap(finals, "iqm", seed=seed) if finals else None
        preset = conf.runs[0].config.get("preset") or ""
        paper, source = PAPER.get(str(preset), ("", ""))
        rows.append(
            ReportRow(
                configuration=conf.label,
                task=conf.task,
                algo=conf.runs[0].algo,
                metric=name,
                seeds=len(runs),
                env_steps=_mean([run.final("env_steps") for run in runs]),
                wall_seconds=_mean([run.final("wall_seconds") for run in runs]),
                final_mean=_mean(finals),
                best_mean=_mean(bests),
                final_iqm=interval.value if interval else math.nan,
                final_iqm_low=interval.low if interval else math.nan,
                final_iqm_high=interval.high if interval else math.nan,
                paper=paper,
                paper_source=source,
            )
        )
    return rows


def _num(value: float, digits: int = 2) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.{digits}f}"


def _steps(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.0f}k"


def format_markdown(rows: list[ReportRow]) -> str:
    """A Markdown table with the metric named above it."""
    metrics = sorted({r.metric for r in rows})
    head = (
        "| configuration | seeds | env steps | wall | final (mean) | best (mean) | "
        "final IQM [95% CI] | paper code |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        paper = f"{r.paper} ({r.paper_source})" if r.paper else ""
        lines.append(
            f"| {r.configuration} | {r.seeds} | {_steps(r.env_steps)} | "
            f"{_num(r.wall_seconds, 0)} s | {_num(r.final_mean)} | {_num(r.best_mean)} | "
            f"{_num(r.final_iqm)} [{_num(r.final_iqm_low)}, {_num(r.final_iqm_high)}] | {paper} |"
        )
    return f"Metric: `{'`, `'.join(metrics)}` (greedy evaluation)\n\n" + head + "\n".join(lines)


def format_csv(rows: list[ReportRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(asdict(rows[0])) if rows else [])
    writer.writeheader()
    writer.writerows(asdict(r) for r in rows)
    return out.getvalue()


def format_json(rows: list[ReportRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


FORMATS = {"markdown": format_markdown, "csv": format_csv, "json": format_json}


def marl_eval(configs: list[Configuration], metric: str | None = None) -> dict[str, Any]:
    """The runs in marl-eval's raw-data layout:
    ``{env: {task: {algorithm: {run: {"step_i": {"step_count", metric: [...]},
    "absolute_metrics": {metric: [...]}}}}}}``.

    ``env``/``task`` split the env name at its first ``/`` (``smac``/``3m``); the algorithm is
    the configuration's label; runs are ``seed_<k>``. mappo logs the mean of each evaluation,
    not its episodes, so every list holds that one mean; the metric is ``win_rate`` for battle
    wins and ``return`` otherwise. ``absolute_metrics`` is the final evaluation.
    """
    out: dict[str, Any] = {}
    for conf in configs:
        column = metric or default_metric(conf.runs)
        name = "win_rate" if column == WIN_RATE else "return"
        env, _, task = conf.task.partition("/")
        algo = out.setdefault(env, {}).setdefault(task or env, {}).setdefault(conf.label, {})
        for run in with_values(conf, column):
            algo[_run_name(run, algo)] = _marl_eval_run(run, column, name)
    return out


def _run_name(run: RunRecord, taken: dict[str, Any]) -> str:
    name, k = f"seed_{run.seed}", 1
    while name in taken:  # two runs of one seed (e.g. repeated by hand): keep both
        name, k = f"seed_{run.seed}_{k}", k + 1
    return name


def _marl_eval_run(run: RunRecord, metric: str, name: str) -> dict[str, Any]:
    steps, values = run.curve(metric)
    record: dict[str, Any] = {
        f"step_{i}": {"step_count": int(s), name: [float(v)]}
        for i, (s, v) in enumerate(zip(steps, values, strict=True))
    }
    record["absolute_metrics"] = {name: [float(values[-1])] if values.size else []}
    return record
