"""Run directories read back for comparison: found at any depth, grouped by configuration.

A run directory is any folder holding both ``config.yaml`` and ``metrics.csv`` (what
:func:`mappo.train` and every sweep trial write). Runs whose configs differ only in the seed or in
keys that do not change what is learned (threads, device, logging, the budget...) are one
*configuration*: its seeds are aggregated in plots and reports.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mappo import config as config_mod
from mappo.logging import complete_rows

# Keys that do not change what a run learns: runs differing only in these are seeds of one
# configuration. total_env_steps is here so that a seed stopped early or extended still counts.
BOOKKEEPING_KEYS = (
    "seed",
    "run_dir",
    "threads",
    "device",
    "progress",
    "tensorboard",
    "wandb",
    "wandb_project",
    "total_env_steps",
    "max_wall_seconds",
    "eval_interval",
    "eval_episodes",
    "log_interval",
    "checkpoint_interval",
    "keep_checkpoints",
    "preset",
    "algo.buffer_in_checkpoints",
    "compile",  # the same updates, compiled or not
    "num_seeds",  # seeds trained together learn what they would alone
)
WIN_RATE = "eval/eval_battle_won"
RETURN = "eval/eval_return_mean"


def is_bookkeeping(key: str, config: dict[str, Any]) -> bool:
    """Whether the flattened ``config``'s ``key`` leaves what the run learns unchanged
    (:data:`BOOKKEEPING_KEYS`). The budget is not, where the learning rates decay to zero over
    it (``algo.lr_decay``): there runs of two budgets follow two schedules."""
    if key == "total_env_steps" and config.get("algo.lr_decay"):
        return False
    return key in BOOKKEEPING_KEYS


def full_config(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``config.yaml`` as a nested dict) flattened with every key of this
    version: keys added since the run was written take their defaults, so that an older run and
    a newer one with the same settings compare equal. A config this version cannot read is
    flattened as it is."""
    try:
        return config_mod._flatten(config_mod.to_dict(config_mod.from_dict(data)))
    except (ValueError, TypeError):
        return config_mod._flatten(data)


class ResultsError(ValueError):
    """Run directories that cannot be read or compared; the message says what to do."""


@dataclass
class RunRecord:
    """One run directory read back: its flattened config and its ``metrics.csv`` columns."""

    dir: Path
    config: dict[str, Any]
    """The flattened config (``{"algo.clip": 0.2, ...}``) as written to ``config.yaml``."""
    columns: dict[str, np.ndarray]
    """``metrics.csv`` as float arrays ``[rows]``, NaN where a row has no value."""
    summary: dict[str, Any] | None = None
    algo: str = ""
    """The algorithm label (``rmappo``, ``qmix``...) as the run directory names it."""
    nonfinite: dict[str, int] = field(default_factory=dict)
    """Per column, its values written as NaN, inf or text: read as NaN, they are left out as
    rows without a value are, and named in a warning (:func:`with_values`)."""
    error: str = ""
    """The last line of the folder's ``error.txt`` (the exception of a sweep trial that
    failed), empty without one."""

    @property
    def complete(self) -> bool:
        """Whether the run trained its budget: its ``summary.json`` (written at a run's end)
        counts at least ``total_env_steps``. Its figures are then at that budget, not where
        the run stopped."""
        try:
            steps = int((self.summary or {})["env_steps"])
            budget = int(self.config.get("total_env_steps") or 0)
        except (KeyError, TypeError, ValueError):
            return False
        return steps >= budget

    @property
    def failed(self) -> bool:
        """Whether the run stopped on an error (an ``error.txt``, which a sweep writes; one left
        from before a run resumed outside the sweep and completed does not count)."""
        return bool(self.error) and not self.complete

    @property
    def diverged(self) -> bool:
        """Whether the run failed with :class:`mappo.trainer.TrainingDiverged`."""
        return self.failed and "TrainingDiverged" in self.error

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def task(self) -> str:
        return str(self.config.get("env.name", "?"))

    @property
    def source(self) -> str:
        """The preset the run came from, or its env name for a YAML file's config."""
        return str(self.config.get("preset") or self.task)

    @property
    def iteration_steps(self) -> float:
        """The env steps of one of the run's iterations, as its rows tell: the largest mean over
        the iterations between two logged rows (0 without an ``iteration`` column). A MAPPO
        iteration is a fixed rollout; the value family's are whole episodes, which vary."""
        iterations = self.columns.get("iteration")
        if iterations is None:
            return 0.0
        steps = self.columns["env_steps"]
        keep = np.isfinite(steps) & np.isfinite(iterations)
        # (``iteration`` counts the iterations done, so a row at zero of both starts the run)
        d_steps = np.diff(steps[keep], prepend=0.0)
        d_iterations = np.diff(iterations[keep], prepend=0.0)
        per = d_steps[d_iterations > 0] / d_iterations[d_iterations > 0]
        return float(per.max()) if per.size else 0.0

    def curve(self, metric: str, x: str = "env_steps") -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` at the rows where ``metric`` was logged; both ``[k]``."""
        if metric not in self.columns:
            raise ResultsError(
                f"'{self.dir / 'metrics.csv'}' has no column '{metric}'; its columns: "
                f"{', '.join(sorted(self.columns))}"
            )
        y = self.columns[metric]
        keep = np.isfinite(y) & np.isfinite(self.columns[x])
        return self.columns[x][keep], y[keep]

    def final(self, column: str) -> float:
        """The last logged value of ``column`` (NaN if there is none)."""
        values = self.columns.get(column)
        if values is None:
            return math.nan
        finite = values[np.isfinite(values)]
        return float(finite[-1]) if finite.size else math.nan


@dataclass
class Configuration:
    """The seeds of one configuration and a label that tells it apart from the others."""

    label: str
    runs: list[RunRecord] = field(default_factory=list)
    key: tuple = ()

    @property
    def task(self) -> str:
        return self.runs[0].task


def _float(text: str) -> float:
    try:
        return float(text) if text != "" else math.nan
    except ValueError:
        return math.nan


def _is_number(text: str) -> bool:
    """Whether ``text`` is empty or a number (``nan`` and ``inf`` included, as logged)."""
    try:
        float(text) if text.strip() else None
    except ValueError:
        return False
    return True


def read_run(path: Path) -> RunRecord:
    """One run directory: ``config.yaml`` (safe YAML), ``metrics.csv`` and ``summary.json``."""
    try:
        data = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
        # (a sweep's trial that failed before its first row has its config and error only)
        text = "env_steps\n" if _failed_unlogged(path) else complete_rows(path / "metrics.csv")
        reader = csv.DictReader(io.StringIO(text, newline=""))
        names = list(reader.fieldnames or [])
        rows = list(reader)
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ResultsError(
            f"cannot read run '{path}': its config.yaml is not valid YAML ({first}); repair "
            "or remove that run, or name the other runs only"
        ) from None
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ResultsError(f"cannot read run '{path}': {err}") from None
    if not isinstance(data, dict):
        raise ResultsError(
            f"'{path}' is not a run directory of mappo: its config.yaml holds no config"
        )
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ResultsError(
            f"'{path / 'config.yaml'}' has seed {seed!r}, not a whole number: repair that line "
            "(its checkpoints hold the run's config), or leave the run out"
        )
    if not names:  # (empty, or killed before its header's line end)
        raise ResultsError(
            f"'{path / 'metrics.csv'}' is empty or its header line is incomplete: the run "
            "logged nothing readable; leave that run out"
        )
    if "env_steps" not in names:
        header = ",".join(names[:4]) + (",..." if len(names) > 4 else "")
        raise ResultsError(
            f"'{path / 'metrics.csv'}' has no env_steps column (its first line: {header!r}): a "
            "damaged header, or not a metrics file of mappo; restore its first line"
        )
    flat = full_config(data)
    columns, nonfinite = {}, {}
    for name in names:
        texts = [r.get(name) or "" for r in rows]
        columns[name] = np.array([_float(t) for t in texts])
        for k in np.flatnonzero(~np.isfinite(columns[name])):  # (empty, nan, inf or text)
            if not _is_number(texts[k]):
                raise ResultsError(
                    f"'{path / 'metrics.csv'}' has {texts[k].strip()!r} in its column '{name}' "
                    f"(line {k + 2}), which is no number: the file is damaged; repair that "
                    "line, or leave the run out"
                )
        written = sum(1 for t in texts if t.strip())
        if written > np.isfinite(columns[name]).sum():
            nonfinite[name] = int(written - np.isfinite(columns[name]).sum())
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            summary = None
    try:
        algo = config_mod.from_dict(data).algo_name
    except (ValueError, TypeError):  # a config written by another version: its raw label
        algo = str(flat.get("name") or flat.get("algo.name", "?"))
    return RunRecord(path, flat, columns, summary, algo, nonfinite, _error_line(path))


def _error_line(path: Path) -> str:
    """The last non-blank line of ``path/error.txt`` (its exception), empty without one."""
    try:
        lines = (path / "error.txt").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "error.txt")


def last_logged_step(path: Path) -> int | None:
    """The env step of the last row of ``path/metrics.csv`` (None without a readable row)."""
    try:
        rows = list(csv.DictReader(io.StringIO(complete_rows(path / "metrics.csv"), newline="")))
        return int(float(rows[-1]["env_steps"]))
    except (OSError, UnicodeDecodeError, csv.Error, IndexError, KeyError, TypeError, ValueError):
        return None


def _failed_unlogged(path: Path) -> bool:
    """Whether ``path`` is a sweep trial that failed before its first logged row: its
    ``config.yaml`` and ``error.txt``, no ``metrics.csv``."""
    files = ("config.yaml", "error.txt")
    return all((path / f).is_file() for f in files) and not (path / "metrics.csv").exists()


def find_runs(paths: list[str | Path]) -> list[RunRecord]:
    """Every run directory under ``paths`` (at any depth; a path may be a run directory itself),
    in sorted order; runs with no logged row yet are left out, but for a sweep's trials that
    failed before it (which reports count as failed seeds of their configuration)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ResultsError(f"'{p}' does not exist")
        if ((p / "metrics.csv").is_file() and (p / "config.yaml").is_file()) or (
            _failed_unlogged(p)
        ):
            found.append(p)
        found += sorted(
            m.parent
            for m in [*p.rglob("metrics.csv"), *p.rglob("error.txt")]
            if m.parent != p
            and (m.parent / "config.yaml").is_file()
            and (m.name == "metrics.csv" or _failed_unlogged(m.parent))
        )
    runs = [read_run(p) for p in dict.fromkeys(found)]
    runs = [r for r in runs if r.columns["env_steps"].size or r.failed]
    if not runs:
        raise ResultsError(
            "no run directories (with config.yaml and metrics.csv) under "
            + ", ".join(map(str, paths))
        )
    return runs


def _value_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def setting_items(config: dict[str, Any]) -> list[tuple[str, str]]:
    """A flattened config's ``(key, value text)`` pairs without bookkeeping keys, with a dict
    value (an env's ``env.kwargs``) spread into one pair per entry, so that configurations that
    differ in one keyword argument are labelled by it (``env.kwargs.time_feature=True``)."""
    items = []
    for k, v in config.items():
        if is_bookkeeping(k, config):
            continue
        if isinstance(v, dict):
            items.extend((f"{k}.{name}", _value_text(sub)) for name, sub in v.items())
        else:
            items.append((k, _value_text(v)))
    return sorted(items)


def group_runs(runs: list[RunRecord]) -> list[Configuration]:
    """Group runs into configurations (equal config apart from seed and bookkeeping keys).

    Labels are ``<preset or task> <algo>`` followed by ``key=value`` for the keys in which
    configurations of the same preset and algorithm differ (e.g. ``algo.clip=0.1``).
    """
    groups: dict[tuple, Configuration] = {}
    for run in runs:
        # Not keyed by the preset (bookkeeping): a YAML file's run with a preset's settings is
        # a seed of that preset's configuration, labelled by the preset where a run names one.
        key = (run.algo, *setting_items(run.config))
        conf = groups.get(key)
        if conf is None:
            conf = groups[key] = Configuration(label="", key=(run.source, *key))
        elif run.config.get("preset") and not any(r.config.get("preset") for r in conf.runs):
            conf.key = (run.source, *key)
        conf.runs.append(run)
    configs = list(groups.values())
    for conf in configs:
        siblings = [c for c in configs if c.key[:2] == conf.key[:2]]
        mine = dict(conf.key[2:])
        varying = sorted(
            k
            for k in {k for c in siblings for k, _ in c.key[2:]} | set(mine)
            if len({dict(c.key[2:]).get(k) for c in siblings}) > 1
        )
        extra = " ".join(f"{k}={mine.get(k, '-')}" for k in varying)
        conf.label = f"{conf.key[0]} {conf.key[1]}" + (f" {extra}" if extra else "")
        conf.runs = _one_run_per_seed(conf)
    return sorted(configs, key=lambda c: c.label)


def _one_run_per_seed(conf: Configuration) -> list[RunRecord]:
    """``conf``'s runs, one per seed, sorted by seed: a seed trained again (the same command
    run twice) learns what it learned the first time, and counted twice it would narrow the
    confidence intervals. Of repeats, the run that trained furthest (then the latest folder)
    counts; the others are named in a warning."""
    kept: dict[int, RunRecord] = {}

    def trained(run: RunRecord) -> float:
        steps = run.columns["env_steps"]
        return float(steps[-1]) if steps.size else -math.inf

    for run in sorted(conf.runs, key=lambda r: (trained(r), str(r.dir))):
        kept[run.seed] = run  # the run that trained furthest comes last
    dropped = [r for r in conf.runs if kept[r.seed] is not r]
    if dropped:
        names = ", ".join(f"'{r.dir}' (seed {r.seed})" for r in dropped[:3])
        more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        warnings.warn(
            f"'{conf.label}': {names}{more} {'repeats' if len(dropped) == 1 else 'repeat'} "
            "a seed of another run of this "
            "configuration; each seed counts once (the run that trained furthest)",
            stacklevel=3,
        )
    return sorted(kept.values(), key=lambda r: r.seed)


def check_metric(runs: list[RunRecord], metric: str) -> str:
    """``metric`` as the column the runs log it in: a name as ``mappo train`` prints it and
    ``summary.json`` holds it (``eval_return_mean``, ``train_episode_return``) reads as its
    column (``eval/eval_return_mean``, ``train/episode_return``). A metric that no run logs is
    refused, with the nearest column and the evaluation and training columns (metrics.csv has
    some thirty)."""
    columns = sorted({c for r in runs for c in r.columns})
    if metric in columns:
        return metric
    if "/" not in metric:  # (summary.json's eval_x is eval/eval_x, its train_x train/x)
        for column in (f"eval/{metric}", metric.replace("_", "/", 1)):
            if column in columns:
                return column
    if metric.startswith("eval/") and not any(c.startswith("eval/") for c in columns):
        raise not_evaluated(metric)
    close = difflib.get_close_matches(metric, columns, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    listed = [c for c in columns if c.startswith(("eval/", "train/"))] or columns
    raise ResultsError(
        f"no run logs the column '{metric}'{hint} (the runs' evaluation and training columns: "
        f"{', '.join(listed)})"
    )


def not_evaluated(metric: str) -> ResultsError:
    """The error for runs of which none has a value of ``metric`` yet."""
    if not metric.startswith("eval/"):
        return ResultsError(f"no run has a value of '{metric}' yet; try again once they log it")
    return ResultsError(
        f"no run has evaluated yet (no value of '{metric}'; a run evaluates every eval_interval "
        "iterations and at its end); report or plot again after its first evaluation"
    )


def with_values(conf: Configuration, metric: str, x: str = "env_steps") -> list[RunRecord]:
    """The runs of ``conf`` with at least one value of ``metric``; the others (failed or stopped
    before their first evaluation, or of a task that does not log it) are left out with a
    warning. A run's values that are not finite numbers are left out of its curve, with a
    warning."""
    for run in conf.runs:
        bad = run.nonfinite.get(metric, 0)
        if bad:  # (a damaged or foreign metrics.csv: mappo stops a diverged run before)
            logged = bad + int(np.isfinite(run.columns[metric]).sum())
            warnings.warn(
                f"'{run.dir}' has {bad} NaN or infinite value{'s' if bad > 1 else ''} of "
                f"'{metric}' (of {logged}); left out, so its final value is its last finite one",
                stacklevel=2,
            )
    kept = [r for r in conf.runs if metric in r.columns and r.curve(metric, x)[0].size]
    failed = [r for r in conf.runs if r not in kept and r.failed]
    early = len(conf.runs) - len(kept) - len(failed)
    if failed:
        warnings.warn(
            f"{len(failed)} of {len(conf.runs)} runs of '{conf.label}' failed before any "
            f"'{metric}' value (see error.txt in {', '.join(repr(str(r.dir)) for r in failed)}); "
            "left out",
            stacklevel=2,
        )
    if early:
        warnings.warn(
            f"{early} of {len(conf.runs)} runs of '{conf.label}' have no '{metric}' values "
            "yet; left out",
            stacklevel=2,
        )
    return kept


def never_logs(runs: list[RunRecord], metric: str) -> bool:
    """Whether ``runs`` (a configuration's) do not log ``metric``: none has its column, though
    they already have columns of its kind. An evaluation's columns appear together with a run's
    first evaluation, so runs that have other ``eval/`` columns but not this one will never log
    it (a particle world's runs and a win rate), while runs without any may only be early."""
    if any(metric in r.columns for r in runs):
        return False
    return not metric.startswith("eval/") or any(
        c.startswith("eval/") for r in runs for c in r.columns
    )


def default_metric(runs: list[RunRecord]) -> str:
    """The greedy win rate where runs log one (StarCraft-style maps), else the greedy return."""
    return WIN_RATE if any(WIN_RATE in r.columns for r in runs) else RETURN


def summary_steps(run_dir: Path) -> int:
    """The env steps that ``run_dir/summary.json`` counts (0 without a readable one)."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["env_steps"])
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return 0


def summary_from_checkpoint(run_dir: Path, newest: Path, env_steps: int) -> None:
    """Write ``run_dir/summary.json`` for a run that trained its budget but stopped before its
    summary was written (killed between its final checkpoint and the summary): the env steps of
    its newest checkpoint, so that reports count it as finished. Written whole or not at all."""
    summary = {"env_steps": env_steps, "run_dir": str(run_dir), "from_checkpoint": str(newest)}
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    tmp.replace(run_dir / "summary.json")
