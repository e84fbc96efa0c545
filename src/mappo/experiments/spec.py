"""Sweep specs: the YAML file of a sweep, checked, and the trials it expands to.

See :mod:`mappo.experiments.sweep` for the file's keys and how trials run.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mappo import config as config_mod
from mappo.envs.base import EnvError
from mappo.envs.registry import check_name
from mappo.experiments import runs as runs_mod

SPEC_DIR = Path(__file__).parent / "specs"
_SPEC_KEYS = (
    "name",
    "description",
    "presets",
    "seeds",
    "overrides",
    "grid",
    "resources",
    "max_concurrent",
    "metric",
    "stack_seeds",
)
_RESOURCE_KEYS = ("cpus", "gpus")


class SweepError(config_mod.ConfigError):
    """A spec or sweep directory that cannot be run; the message names the fix (CLI exit 2)."""


@dataclass(frozen=True)
class Trial:
    """One run of a sweep: a preset, its overrides (grid point and seed included) and where."""

    id: str
    """``<preset>/<grid point>/seed<k>``: also the trial's folder inside the sweep directory."""
    preset: str
    overrides: dict[str, Any]
    dir: str
    """Absolute path of the trial's run directory."""
    total_env_steps: int
    family: str = "ppo"
    """The algorithm family (``ppo``, ``value``, ``coma`` or ``maddpg``): only ``ppo`` trials
    stack."""

    @property
    def root(self) -> Path:
        """The sweep directory this trial belongs to."""
        return Path(self.dir).parents[self.id.count("/")]


@dataclass
class SweepSpec:
    """A validated spec and its trials."""

    name: str
    presets: list[str]
    seeds: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    cpus: float = 1.0
    gpus: float = 0.0
    max_concurrent: int = 0
    metric: str = ""
    description: str = ""
    stack_seeds: bool = False
    """Train the seeds of one configuration together, in one process (``num_seeds``)."""
    trials: list[Trial] = field(default_factory=list)


# -- the spec ---------------------------------------------------------------------------------


def list_specs() -> list[str]:
    """Names of the shipped specs, e.g. ``paper/mpe``."""
    return sorted(str(p.relative_to(SPEC_DIR).with_suffix("")) for p in SPEC_DIR.rglob("*.yaml"))


def _spec_path(source: str) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    if source.endswith((".yaml", ".yml")):
        raise SweepError(f"sweep spec '{source}' does not exist")
    shipped = SPEC_DIR / f"{source}.yaml"
    if shipped.is_file():
        return shipped
    close = difflib.get_close_matches(source, list_specs(), n=1, cutoff=0.4)
    hint = f"; did you mean '{close[0]}'?" if close else f" (shipped: {', '.join(list_specs())})"
    raise SweepError(f"no sweep spec file or shipped spec named '{source}'{hint}")


def _label(value: Any) -> str:
    """A grid value as a folder-name-safe text: ``[64, 64]`` -> ``64_64``."""
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_") or "_"


def _check_metric(metric: str, path: Path) -> None:
    """Refuse a ``metric`` that no run can log before any trial trains (a typo would otherwise
    surface as a missing report after the whole sweep)."""
    from mappo.logging import COLUMN_PREFIXES, is_column_name

    if not metric or is_column_name(metric):
        return
    known = [runs_mod.RETURN, runs_mod.WIN_RATE, "train/episode_return"]
    close = difflib.get_close_matches(metric, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise SweepError(
        f"'metric' in '{path}' is '{metric}', which no run logs{hint} (columns of metrics.csv: "
        f"env_steps, wall_seconds... or names starting {', '.join(COLUMN_PREFIXES)}, e.g. "
        f"{runs_mod.RETURN})"
    )


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise SweepError(message)


def _number(value: Any, key: str, low: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    _need(ok and math.isfinite(value) and value >= low, f"'{key}' must be a number >= {low}")
    return float(value)


GENERIC_EVAL_COLUMNS = ("eval/eval_return_mean", "eval/eval_return_std", "eval/eval_episodes")
"""The evaluation columns of every env; the others are env statistics (``eval/eval_<stat>``)."""


def _check_metric_logged(spec: SweepSpec, path: Path) -> None:
    """Refuse an ``eval/eval_<stat>`` metric that none of the sweep's envs logs (a typo such as
    ``eval_retrun_mean``, or a win rate on the particle world), which would otherwise train
    every trial and then write no report. The envs' statistics are read from one copy of each
    (adapted envs in this process, without workers); where one cannot be made, its trials will
    say why, and the metric is let through."""
    from mappo.envs.registry import make, uses_workers

    metric = spec.metric
    if not metric.startswith("eval/eval_") or metric in GENERIC_EVAL_COLUMNS:
        return
    envs: dict[str, set[str]] = {}
    for trial in spec.trials:
        cfg = config_mod.load(trial.preset, dict(trial.overrides), refuse_unread=False)
        key = json.dumps([cfg.env.name, cfg.env.kwargs], sort_keys=True, default=str)
        if key in envs:
            continue
        kwargs = dict(cfg.env.kwargs)
        if uses_workers(cfg.env.name):
            for option in ("timeout", "envs_per_worker", "start_method", "startup_timeout"):
                kwargs.pop(option, None)
            kwargs["num_workers"] = 0
        try:
            with make(cfg.env.name, num_envs=1, seed=cfg.seed, **kwargs) as env:
                envs[key] = {f"eval/eval_{s}" for s in env.spec.stat_names}
        except Exception:  # the trials report it; this check cannot say more
            return
        if metric in envs[key]:
            return
    names = sorted(set(GENERIC_EVAL_COLUMNS).union(*envs.values()))
    close = difflib.get_close_matches(metric, names, n=1, cutoff=0.8)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise SweepError(
        f"'metric' in '{path}' is '{metric}', which none of the sweep's envs logs; {hint}"
        f"(they log {', '.join(names)})"
    )


MAX_TRIALS = 10_000
"""The most trials one sweep may hold: each is checked (its config loaded) when the spec is
read, and a typo of a grid (10**6 points) or of a seed count would otherwise run for hours or
exhaust the memory before saying anything."""


def load_spec(source: str, sweep_dir: str | Path | None = None) -> SweepSpec:
    """Read and check a spec (a YAML path or a shipped name such as ``paper/mpe``) and expand
    its trials; every trial's config is loaded and checked here, before anything runs.

    ``sweep_dir`` defaults to ``sweeps/<name>`` in the current folder."""
    path = _spec_path(source)
    data = config_mod._read_yaml(path)
    for key in data:
        if key not in _SPEC_KEYS:
            close = difflib.get_close_matches(str(key), _SPEC_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (keys: {', '.join(_SPEC_KEYS)})"
            raise SweepError(f"unknown sweep spec key '{key}' in '{path}'{hint}")
    default_name = (
        str(path.relative_to(SPEC_DIR).with_suffix(""))
        if path.is_relative_to(SPEC_DIR)
        else path.stem
    )
    name = data.get("name", default_name)
    _need(
        isinstance(name, str) and bool(name) and ".." not in name and not name.startswith("/"),
        f"'name' in '{path}' must be a folder name inside the sweeps folder, got {name!r}",
    )
    presets = data.get("presets")
    if isinstance(presets, str):
        presets = [presets]
    _need(
        isinstance(presets, list) and bool(presets) and all(isinstance(p, str) for p in presets),
        f"'presets' in '{path}' must be a list of preset names or YAML files, e.g. "
        "[mpe/simple_spread_fast]",
    )
    seeds = data.get("seeds", [1])
    if isinstance(seeds, int) and not isinstance(seeds, bool) and seeds >= 1:
        _need(
            seeds <= MAX_TRIALS,
            f"'seeds' in '{path}' asks for {seeds:,} seeds; a sweep holds at most "
            f"{MAX_TRIALS:,} trials: split it into sweeps of fewer",
        )
        seeds = list(range(1, seeds + 1))
    _need(
        isinstance(seeds, list)
        and bool(seeds)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        and len(set(seeds)) == len(seeds),
        f"'seeds' in '{path}' must be a count (3 means [1, 2, 3]) or a list of distinct "
        f"non-negative integers, got {seeds!r}",
    )
    overrides = data.get("overrides") or {}
    _need(isinstance(overrides, dict), f"'overrides' in '{path}' must map config keys to values")
    grid = data.get("grid") or {}
    _need(
        isinstance(grid, dict) and all(isinstance(v, list) and v for v in grid.values()),
        f"'grid' in '{path}' must map config keys to non-empty lists of values, e.g. "
        "{algo.clip: [0.1, 0.2]}",
    )
    points = math.prod(len(v) for v in grid.values()) if isinstance(grid, dict) else 1
    trials = len(presets) * points * len(seeds)
    _need(
        trials <= MAX_TRIALS,
        f"'{path}' asks for {trials:,} trials ({len(presets)} presets x {points:,} grid points "
        f"x {len(seeds):,} seeds); a sweep holds at most {MAX_TRIALS:,}: split it into sweeps "
        "of fewer",
    )
    both = sorted(set(grid) & set(overrides))
    _need(not both, f"'{both[0] if both else ''}' is in both 'grid' and 'overrides' of '{path}'")
    _need("seed" not in grid and "seed" not in overrides, f"give seeds as 'seeds:' in '{path}'")
    resources = data.get("resources") or {}
    _need(isinstance(resources, dict), f"'resources' in '{path}' must be {{cpus: N, gpus: N}}")
    for key in resources:
        _need(key in _RESOURCE_KEYS, f"unknown resource '{key}' in '{path}' (cpus, gpus)")
    spec = SweepSpec(
        name=name,
        presets=list(presets),
        seeds=list(seeds),
        overrides=dict(overrides),
        grid={k: list(v) for k, v in grid.items()},
        cpus=_number(resources.get("cpus", 1), "resources.cpus", 0.01),
        gpus=_number(resources.get("gpus", 0), "resources.gpus", 0.0),
        description=str(data.get("description", "")),
    )
    spec.max_concurrent = int(_number(data.get("max_concurrent", 0), "max_concurrent", 0))
    spec.metric = str(data.get("metric", "") or "")
    _check_metric(spec.metric, path)
    stack = data.get("stack_seeds", False)
    _need(isinstance(stack, bool), f"'stack_seeds' in '{path}' must be true or false")
    spec.stack_seeds = stack
    root = Path(sweep_dir) if sweep_dir is not None else Path("sweeps") / spec.name
    spec.trials = _expand(spec, root.resolve(), path)
    _check_metric_logged(spec, path)
    return spec


def _expand(spec: SweepSpec, root: Path, path: Path) -> list[Trial]:
    trials: list[Trial] = []
    keys = list(spec.grid)
    # The sweep's own keys that no trial reads (n_step under one-step targets): its trials
    # would differ in name only, and a report would show the setting as making no difference.
    unread: dict[str, str] | None = None
    for preset in spec.presets:
        preset_dir = preset
        if preset.endswith((".yaml", ".yml")) or Path(preset).is_file():
            # A relative path is read from the spec's folder where the file is there (else from
            # the working folder); trials may run in another folder (a Ray worker), so they get
            # the file's absolute path.
            beside = path.parent / preset
            file = beside if not Path(preset).is_absolute() and beside.is_file() else Path(preset)
            preset_dir, preset = file.stem, str(file.resolve())
        for values in itertools.product(*(spec.grid[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            point_dir = ",".join(f"{k}={_label(v)}" for k, v in point.items()) or "default"
            for seed in spec.seeds:
                overrides = {**spec.overrides, **point, "seed": seed}
                # A trial's torch threads follow its CPU share, so that parallel trials do not
                # oversubscribe the cores (unless the spec sets threads itself).
                overrides.setdefault("threads", max(1, int(spec.cpus)))
                overrides.setdefault("progress", False)
                trial_id = f"{preset_dir}/{point_dir}/seed{seed}"
                _check_folder(trial_id, trials, path)
                try:
                    cfg = config_mod.load(preset, overrides, refuse_unread=False)
                except config_mod.ConfigError as err:
                    raise SweepError(f"trial {trial_id} of '{path}': {err}") from None
                own = config_mod.given_keys({**spec.overrides, **point}, cfg)
                here = dict(config_mod.unread(cfg, own))
                unread = here if unread is None else {k: unread[k] for k in unread if k in here}
                try:  # an env name's typo, before any trial trains
                    check_name(cfg.env.name)
                except EnvError as err:
                    raise SweepError(f"trial {trial_id} of '{path}': {err}") from None
                if "run_dir" in own:  # the sweep puts each trial's folder itself
                    raise SweepError(
                        f"trial {trial_id} of '{path}' sets 'run_dir', which the sweep sets for "
                        "each trial (its folder under the sweep's --dir); drop it"
                    )
                if cfg.num_seeds > 1:
                    raise SweepError(
                        f"trial {trial_id} of '{path}' sets num_seeds={cfg.num_seeds}, but a "
                        "sweep trial is one run; list the seeds under 'seeds' instead"
                    )
                if spec.gpus > 0 and not cfg.device.startswith("cuda"):
                    raise SweepError(
                        f"'resources.gpus' reserves GPUs but trial {trial_id} trains on "
                        f"device={cfg.device}; add device: cuda to 'overrides' in '{path}'"
                    )
                trials.append(
                    Trial(
                        trial_id,
                        preset,
                        overrides,
                        str(root / trial_id),
                        cfg.total_env_steps,
                        cfg.family,
                    )
                )
    if unread:
        key, why = next(iter(unread.items()))
        raise SweepError(f"'{path}': no trial reads '{key}': {why}")
    return trials


def _check_folder(trial_id: str, trials: list[Trial], path: Path) -> None:
    """Two trials must never share a folder, and folder names must fit the filesystem."""
    same = next((t for t in trials if t.id == trial_id), None)
    if same is not None:
        raise SweepError(
            f"two trials of '{path}' would share the folder '{trial_id}' (a preset listed twice, "
            "two YAML presets with one file name, or grid values that print alike); make them "
            "distinct"
        )
    long = next((part for part in trial_id.split("/") if len(part.encode()) > 200), None)
    if long is not None:
        raise SweepError(
            f"the trial folder name '{long[:60]}...' of '{path}' is too long for a filesystem "
            "(over 200 bytes); sweep fewer or shorter grid values"
        )


def check_unchanged(trial: Trial) -> None:
    """Refuse to continue a trial whose folder was trained with other settings than the spec
    now gives (an edited spec or preset): skipping or resuming it would mix configurations.
    The budget (unless the learning rates decay over it), intervals, threads and other
    bookkeeping keys may change."""
    saved_path = Path(trial.dir) / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        # With this version's defaults for keys added since the trial was written.
        saved = runs_mod.full_config(config_mod._read_yaml(saved_path))
    except config_mod.ConfigError:
        return  # unreadable: the trial's own resume reports it
    wanted = config_mod._flatten(
        config_mod.to_dict(config_mod.load(trial.preset, trial.overrides, refuse_unread=False))
    )
    for key in sorted(set(saved) | set(wanted)):
        if saved.get(key) == wanted.get(key):
            continue
        if runs_mod.is_bookkeeping(key, saved) and runs_mod.is_bookkeeping(key, wanted):
            continue
        if key == "total_env_steps":
            raise SweepError(
                f"trial {trial.id} decays its learning rates to zero over total_env_steps="
                f"{saved.get(key)!r} (algo.lr_decay), and the spec now gives {wanted.get(key)!r}: "
                "there the budget is part of the schedule, so another budget is another "
                "configuration; give the sweep a new --dir"
            )
        raise SweepError(
            f"trial {trial.id} was trained with {key}={saved.get(key)!r} but the spec now gives "
            f"{wanted.get(key)!r}; restore the spec, or give the changed sweep a new --dir"
        )
