"""The ``mappo`` command: train, resume, evaluate, render, list, benchmark, and sweep, plot and
report many runs.

Every error a user can cause (a bad config key or value, a missing or unwritable file, a bad
environment parameter, a run sized beyond the machine, an env of one's own that raises) is
printed as one line starting with ``mappo: error:`` and exits with status 2 (``MAPPO_DEBUG=1``
shows its traceback instead). Training that diverges (a NaN or inf loss, gradient or
parameter) exits with status 3, keeping its newest finite checkpoint. SIGINT (Ctrl-C) and SIGTERM
stop training after the current update with a checkpoint and the command that resumes it, with
status 130 and 143. A sweep whose trials failed exits with status 1 after the others finished.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mappo import config as config_mod

EXIT_USAGE = 2
EXIT_DIVERGED = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"mappo: error: {message} (see `{self.prog} --help`)\n")


def _int_at_least(low: int, what: str, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (and <= ``high``), refused as ``must be
    <what>``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


_SEED = _int_at_least(0, "a whole number from 0 to 2**32 - 1", 2**32 - 1)
"""``--seed`` of eval and render: the range of a run's ``seed``. torch's CPU generator keeps only
a seed's low 32 bits, so a larger one would play the episodes of a smaller one."""


_positive_int = _int_at_least(1, "a positive integer")  # a count of episodes or steps
_nonnegative_int = _int_at_least(0, "an integer >= 0")
_THREADS = _int_at_least(0, "a thread count from 0 to 1024 (as the config's threads)", 1024)


def _finite_float(text: str) -> float:
    """An argparse type: a finite number (a level or a target; nan and inf would be ignored)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a duration)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _print_summary(summary: dict) -> None:
    keys = (
        "preset",
        "task",
        "algo",
        "seed",
        "env_steps",
        "wall_seconds",
        "steps_per_second",
        "train_episode_return",
        "eval_return_mean",
        "eval_return_std",
        "run_dir",
    )
    print("result:")
    for k in keys:
        v = summary.get(k)
        if k == "preset" and v is None:  # a run made from overrides (env.name=...) has none
            continue
        if isinstance(v, float):
            v = f"{v:,.2f}" if k != "steps_per_second" else f"{v:,.0f}"
        print(f"  {k:22s} {v}")
    extra = {k: v for k, v in summary.items() if k.startswith("eval_") and k not in keys}
    for k, v in extra.items():
        print(f"  {k:22s} {_number(k, v)}")


def cmd_train(args: argparse.Namespace) -> int:
    from mappo.trainer import resume, resume_seeds, train, train_seeds

    if args.resume:
        if args.config and "=" not in args.config:
            raise config_mod.ConfigError(
                f"a resumed run keeps its own config: leave out {args.config!r} "
                "(`mappo train --resume RUN_DIR [KEY=VALUE ...]`)"
            )
        dirs, overrides = _resume_words(args)
        if not dirs:
            raise config_mod.ConfigError("give the run directory to resume: --resume RUN_DIR")
        runs = resume_seeds(dirs, overrides) if len(dirs) > 1 else [resume(dirs[0], overrides)]
    else:
        if not args.config:
            raise config_mod.ConfigError(
                "give a preset name or a YAML file, e.g. `mappo train mpe/simple_spread` "
                "(`mappo list` shows the presets), or --resume RUN_DIR"
            )
        folder = Path(args.config)
        if (folder / "config.yaml").is_file() or (folder / "checkpoints").is_dir():
            words = "".join(f" {shlex.quote(w)}" for w in args.overrides) + _import_option(folder)
            raise config_mod.ConfigError(
                f"'{folder}' is a run directory; continue it with `mappo train --resume "
                f"{shlex.quote(str(folder))}{words}` (a preset name or a YAML file starts a new "
                "run)"
            )
        cfg = config_mod.load(args.config, args.overrides)
        runs = train_seeds(cfg) if cfg.num_seeds > 1 else [train(cfg)]
    for run in runs:
        _print_summary(run.summary)
    if len(runs) > 1:
        _print_seeds([run.summary for run in runs])
    limit = runs[0].summary.get("stopped_at_max_wall_seconds")
    if limit is not None:
        dirs = shlex.join(str(run.dir) for run in runs) + _import_option(runs[0].dir)
        print(
            f"mappo: stopped at max_wall_seconds={limit:g} after {runs[0].summary['env_steps']:,}"
            f" of {runs[0].config.total_env_steps:,} env steps; continue with `mappo train "
            f"--resume {dirs}`",
            file=sys.stderr,
        )
    return 0


def _resume_words(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The run directories and the overrides of `--resume DIR [DIR ...] [KEY=VALUE ...]`:
    argparse gives every word after --resume to it; the overrides are the words with '=' that
    are not run directories (and any given before --resume)."""
    dirs = [d for d in args.resume if "=" not in d or Path(d).is_dir()]
    overrides = [d for d in args.resume if d not in dirs]
    return dirs, overrides + ([args.config] if args.config else []) + args.overrides


def _print_seeds(summaries: list[dict]) -> None:
    """The seeds of a stacked run side by side: mean and spread of their results."""
    print(f"seeds ({len(summaries)}, trained together):")
    for k in ("train_episode_return", "eval_return_mean"):
        values = [s[k] for s in summaries if isinstance(s.get(k), float)]
        if values:
            mean = sum(values) / len(values)
            text = ", ".join(f"{v:,.2f}" for v in values)
            print(f"  {k:22s} mean {mean:,.2f} ({text})")
    total = sum(s.get("steps_per_second") or 0.0 for s in summaries)
    print(f"  {'steps_per_second':22s} {total:,.0f} (all seeds)")


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:  # (counts as whole numbers, as the table prints them)
        print(json.dumps({k: _count(k, v) for k, v in result.items()}))
        return
    for k, v in result.items():
        print(f"{k:22s} {_number(k, v)}")


def _count(key: str, value: Any) -> Any:
    """A count of episodes or steps as an ``int``; any other value as it is."""
    counts = key.endswith(("episodes", "env_steps"))
    if isinstance(value, float) and counts and value.is_integer():
        return int(value)
    return value


def _number(key: str, value: Any) -> str:
    """A result's value as printed: a count of episodes or steps as a whole number, other
    floats to three decimals."""
    value = _count(key, value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def cmd_eval_scripted(args: argparse.Namespace) -> int:
    from mappo.envs.registry import make
    from mappo.envs.smac.maps import get_map
    from mappo.envs.smac.scripted import evaluate_scripted, scripted_actions

    config_mod.check_device(args.device)
    if args.sample:
        raise config_mod.ConfigError(
            "--sample does not apply to --scripted: the rule-based players choose their moves "
            "by rule, not by sampling (leave --sample out)"
        )
    if args.kwargs:
        raise config_mod.ConfigError(
            f"--scripted plays the env's default parameters; leave out {' '.join(args.kwargs)}"
        )
    if args.gif:
        _check_gif_path(args.gif)  # before the evaluation, which may take long
    if args.path.startswith("hanabi/"):
        from mappo.envs.hanabi.scripted import evaluate_scripted as hanabi_scripted
        from mappo.envs.hanabi.scripted import scripted_moves
        from mappo.envs.registry import list_envs

        names = [entry.name for entry in list_envs()]
        if args.path not in names:
            known = ", ".join(n for n in names if n.startswith("hanabi/"))
            raise config_mod.ConfigError(
                f"unknown Hanabi variant {args.path!r}; the scripted player plays {known}"
            )
        task = args.path
        _check_scripted_memory(task, args.episodes, args.device)
        result = hanabi_scripted(task, args.episodes, args.seed, args.device)

        def act(env: Any, step: Any) -> dict[str, Any]:
            moves = scripted_moves(env)  # only the player to act's move is read
            return {"players": moves[:, None, None].expand(-1, env.rules.players, 1)}

    else:
        from mappo.envs.base import EnvError

        name = args.path.removeprefix("smac/")
        given = Path(args.path)
        if "/" in name or given.suffix == ".pt" or (given / "config.yaml").is_file():
            # a run directory, a checkpoint, or another family's env (mpe/..., vmas/...)
            raise config_mod.ConfigError(
                f"--scripted plays a built-in scripted player on an env, smac/<map> or "
                f"hanabi/<variant>, not {args.path!r}; e.g. mappo eval --scripted hanabi/full-2p "
                "(evaluate a trained run without --scripted)"
            )
        try:
            get_map(name)  # an unknown map is a one-line error naming the nearest one
        except EnvError as err:
            raise EnvError(f"{err} (--scripted plays smac/<map> and hanabi/<variant>)") from err
        task = f"smac/{name}"
        _check_scripted_memory(task, args.episodes, args.device)
        result = evaluate_scripted(name, episodes=args.episodes, seed=args.seed, device=args.device)

        def act(env: Any, step: Any) -> dict[str, Any]:
            return scripted_actions(env, step)

    _print_result(
        {"task": task, "algo": "scripted", **_as_evaluation(result, args.episodes)}, args.json
    )
    if args.gif:
        from mappo.envs.rendering import record_episode, save_gif

        with make(task, num_envs=1, device=args.device, seed=args.seed) as single:
            single.validate_actions = False
            frames = record_episode(single, lambda step: act(single, step))
        save_gif(frames, args.gif)
        if not args.json:
            print(f"wrote {len(frames)} frames to {args.gif}")
    return 0


def _as_evaluation(result: dict[str, float], episodes: int) -> dict[str, float]:
    """A scripted player's results under the names a trained run's evaluation prints
    (``eval_return_mean``, ``eval_battle_won``, ...), so that the two compare line by line."""
    names = {
        "mean_return": "return_mean",
        "std_return": "return_std",
        "mean_length": "episode_length",
    }
    out = {}
    for key, value in result.items():
        if key not in ("episodes", "win_rate"):  # win_rate repeats battle_won
            out[f"eval_{names.get(key, key)}"] = value
        if key == "std_return":  # in the order a trained run's evaluation prints them
            out["eval_episodes"] = float(episodes)
    return out


def _check_scripted_memory(task: str, episodes: int, device: str) -> None:
    """Refuse a scripted evaluation of ``episodes`` episodes at once (one env each) that would
    not fit in the free memory, before its envs are made."""
    import torch

    from mappo.envs.registry import make
    from mappo.resources import available_bytes, env_state_bytes, evaluation_memory_problem

    with make(task, num_envs=1, device=device) as probe:
        problem = evaluation_memory_problem(
            episodes,
            probe.spec,
            env_state_bytes(probe),
            available_bytes(torch.device(device)),
            device,
        )
    if problem is not None:
        raise config_mod.ConfigError(problem)


def cmd_eval(args: argparse.Namespace) -> int:
    from mappo.envs.registry import from_saved

    if args.scripted:
        return cmd_eval_scripted(args)
    with from_saved(args.path):  # the run's env name comes from a file: import nothing it names
        return _eval_saved(args)


def _eval_saved(args: argparse.Namespace) -> int:
    from mappo.api import load_policy
    from mappo.envs.registry import fit_workers, make
    from mappo.envs.rendering import record_episode, render_frame, save_gif

    if args.gif:
        _check_gif_path(args.gif)  # before the evaluation, which may take long
    # the words after the run are env parameters for this evaluation (render_mode=rgb_array)
    fixes = {"seed": "use --seed N", "num_envs": "use --episodes N", "device": "use --device"}
    given = _env_parameters(args.kwargs, "eval", "render_mode=rgb_array", fixes)
    policy = load_policy(args.path, device=args.device)
    cfg = policy.config
    kwargs = {**cfg.env.kwargs, **given}

    def gif_env() -> Any:
        return make(
            cfg.env.name, num_envs=1, device=args.device, seed=args.seed, **fit_workers(kwargs, 1)
        )

    if args.gif:  # an env that cannot draw itself is refused before the evaluation
        # (closed again before the evaluation's env is made: closing a PettingZoo MPE env
        # quits pygame, which would leave an env still open unable to draw its text)
        with gif_env() as single:
            single.reset(seed=args.seed)
            render_frame(single)
    result = policy.evaluate(
        args.episodes, args.seed, not args.sample, _sampling(args, policy.device), **given
    )
    actions = "sampled" if args.sample else "greedy"
    result = {"task": cfg.env.name, "algo": cfg.algo_name, "actions": actions, **result}
    if policy.env_steps is not None:  # which checkpoint: a run may still be training
        result["trained_env_steps"] = float(policy.env_steps)
    # The evaluation is printed first: a GIF that cannot be written does not lose it.
    _print_result(result, args.json)
    if args.gif:
        policy.reset()
        with gif_env() as single:
            gen = _sampling(args, single.device)  # sampled (and repeatable) where it was
            frames = record_episode(
                single,
                lambda step: policy.act(step, deterministic=not args.sample, generator=gen),
                seed=args.seed,
            )
        save_gif(frames, args.gif)
        if not args.json:
            print(f"wrote {len(frames)} frames to {args.gif}")
    return 0


def _sampling(args: argparse.Namespace, device: Any) -> Any:
    """With ``--sample``, a ``torch.Generator`` on ``device`` seeded from ``--seed`` (sampled
    evaluations repeat); ``None`` for greedy ones, which draw nothing."""
    if not args.sample:
        return None
    import torch

    return torch.Generator(device=device).manual_seed(args.seed)


def _env_parameters(
    words: list[str], command: str, example: str, fixes: dict[str, str]
) -> dict[str, Any]:
    """The env parameters that ``command`` (eval, render) takes as ``KEY=VALUE`` words
    (``env.kwargs.KEY=VALUE`` too); ``fixes``: the env arguments the command sets itself, with
    the option that sets them. Values must be finite."""
    kwargs = config_mod.parse_overrides(words, example) if words else {}
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = key.removeprefix("env.kwargs.")
        if name in fixes:
            raise config_mod.ConfigError(
                f"'{key}=' is not an env parameter here: {command} sets it itself ({fixes[name]})"
            )
        if not name.isidentifier():
            raise config_mod.ConfigError(
                f"{command} takes the env's parameters only ({example} or env.kwargs.NAME=VALUE), "
                f"got '{key}='"
            )
        out[name] = value
    bad = config_mod.non_finite(out, "")
    if bad is not None:
        raise config_mod.ConfigError(
            f"env parameter '{bad[0].lstrip('.')}' is {bad[1]}; env parameters must be finite"
        )
    return out


def _check_gif_path(path: Path) -> None:
    """Refuse a --gif destination that cannot take a GIF, before any frame is rendered."""
    if path.is_dir():
        raise config_mod.ConfigError(f"--gif '{path}' is a directory; name a .gif file in it")
    if path.suffix.lower() != ".gif":
        raise config_mod.ConfigError(f"--gif must name a .gif file, got '{path}'")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise config_mod.ConfigError(f"--gif: folder '{parent}' does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise config_mod.ConfigError(f"--gif: cannot write '{path}' (permission denied)")
    # The GIF is written beside it first (name.gif.part) and then renamed: try that file now,
    # which os.access cannot judge for every file system (a root user on /proc, a full disk)
    partial = path.with_name(path.name + ".part")
    existed = partial.exists()
    try:
        with open(partial, "ab"):
            pass
    except OSError as err:
        raise config_mod.ConfigError(
            f"--gif: cannot write '{path}' ({err.strerror or type(err).__name__}); name a "
            "file in a folder you can write"
        ) from None
    if not existed:
        partial.unlink(missing_ok=True)


def cmd_render(args: argparse.Namespace) -> int:
    from mappo.envs.registry import list_envs, make
    from mappo.envs.rendering import record_steps, save_gif

    # the words after the env's name are its parameters, e.g. num_agents=4
    fixes = {
        "seed": "use --seed N",
        "num_envs": "it draws one env",
        "device": "it draws on the CPU",
    }
    kwargs = _env_parameters(args.kwargs, "render", "num_agents=4", fixes)
    given = Path(args.env)
    if given.is_file() or (given / "config.yaml").is_file():  # a run or a checkpoint
        raise config_mod.ConfigError(
            f"render draws an env by name with random actions, and '{args.env}' is a path; to "
            f"record a trained run's policy use: mappo eval {shlex.quote(args.env)} --gif out.gif"
        )
    _check_gif_path(args.gif)
    name = args.env
    if ":" not in name and name not in {e.name for e in list_envs()}:
        if name in config_mod.list_presets():  # (lbf/8x8-2p-2f-coop: a gymnasium id's env)
            preset = config_mod.load(name)
            name, kwargs = preset.env.name, {**preset.env.kwargs, **kwargs}
            kwargs.pop("num_workers", None)  # (one env, drawn in this process)
    with make(name, num_envs=1, seed=args.seed, **kwargs) as env:
        frames, taken, ended = record_steps(env, None, num_steps=args.steps)
    save_gif(frames, args.gif)
    note = (
        f" (the episode ended after {taken} of the --steps {args.steps})"
        if ended and args.steps is not None
        else ""
    )
    print(f"wrote {len(frames)} frames to {args.gif}{note}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from mappo.envs.registry import list_envs
    from mappo.experiments.sweep import list_specs

    if args.keys:
        print(config_mod.describe_keys())
        return 0
    print("presets (mappo train PRESET):")
    for name in config_mod.list_presets():
        print(f"  {name}")
    print("environments (env.name=...):")
    for entry in list_envs():
        print(f"  {entry.name:36s} {entry.description}")
    print("  pettingzoo:<module>.<env>            any PettingZoo ParallelEnv (extra: pettingzoo)")
    print("  gymnasium:<package>:<id>             Gymnasium multi-agent envs (extras: lbf, rware)")
    print("  python:<module>:<class>              a BatchedEnv of your own, by import path")
    print("sweep specs (mappo sweep SPEC):")
    for name in list_specs():
        print(f"  {name}")
    return 0


def cmd_bench_env(args: argparse.Namespace) -> int:
    from mappo.bench.env import format_table, run_env_bench
    from mappo.envs.registry import check_name

    config_mod.check_device(args.device)
    for name in args.envs:  # every name before any timing (a late typo lost the rows before it)
        check_name(name)
    rows: list[dict[str, Any]] = []
    try:
        run_env_bench(
            env_names=tuple(args.envs),
            num_envs=tuple(args.num_envs),
            seconds=args.seconds,
            device=args.device,
            include_pettingzoo=not args.no_pettingzoo,
            num_threads=args.threads or None,  # (None: torch's setting stays)
            compiled=args.compile,
            hanabi_backends=tuple(args.hanabi_backend),
            rows=rows,
        )
    except KeyboardInterrupt:
        if not rows:
            raise
        # The rows measured before Ctrl-C are kept: a long bench stopped early still reports.
        print(json.dumps(rows) if args.json else format_table(rows))
        rows_text = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
        print(f"mappo: interrupted; printed the {rows_text} measured before it", file=sys.stderr)
        return 128 + signal.SIGINT
    print(json.dumps(rows) if args.json else format_table(rows))
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from mappo.bench.train import format_report, run_train_bench

    cfg = config_mod.load(args.config, args.overrides)
    report = run_train_bench(cfg, iterations=args.iterations, warmup=args.warmup)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _check_sweep_devices(spec: Any, path: str) -> None:
    """Refuse a sweep whose trials ask for CUDA on a machine without it, before any trial
    folder is written (each trial would fail the same way). Not for a Ray cluster given by
    ``--address``, whose nodes may have the GPUs this machine lacks."""
    import torch

    from mappo.experiments.spec import SweepError

    if torch.cuda.is_available():
        return
    for trial in spec.trials:
        device = str(trial.overrides.get("device", ""))
        if not device:
            device = config_mod.load(trial.preset, trial.overrides, refuse_unread=False).device
        if device.startswith("cuda"):
            raise SweepError(
                f"trial {trial.id} of '{path}' trains on device={device}, but no CUDA device "
                "is available here; set device: cpu in the spec's overrides, or run the sweep "
                "on a Ray cluster with GPUs (--address)"
            )


def cmd_sweep(args: argparse.Namespace) -> int:
    from mappo.experiments.sweep import (
        FINISHED,
        SweepInterrupted,
        check_folder,
        load_spec,
        plan_units,
        run_sweep,
        trial_plan,
        write_outputs,
    )

    spec = load_spec(args.spec, args.dir)
    if args.stack_seeds is not None:  # the flag wins over the spec's stack_seeds
        spec = dataclasses.replace(spec, stack_seeds=args.stack_seeds)
    if args.address is None:  # the trials run on this machine: its devices must serve them
        _check_sweep_devices(spec, args.spec)
    if args.dry_run:
        check_folder(spec)  # the refusals the sweep itself would give
        plans = {t.id: trial_plan(t) for t in spec.trials}
        done = [t for t in spec.trials if plans[t.id] == FINISHED]
        # as the sweep does: finished trials are set aside before the rest are grouped
        for unit in plan_units([t for t in spec.trials if t not in done], spec.stack_seeds):
            if len(unit) > 1:
                print(f"together in one process ({len(unit)} seeds):")
            for trial in unit:
                indent = "  " if len(unit) > 1 else ""
                print(f"{indent}{trial.id}  {trial.dir}  ({plans[trial.id]})")
        for trial in done:
            print(f"{trial.id}  {trial.dir}  ({FINISHED})")
        return 0
    try:
        results = run_sweep(spec, args.backend, args.address, args.max_concurrent)
    except SweepInterrupted as err:
        again = shlex.join(
            ["mappo", "sweep", args.spec]
            + (["--dir", args.dir] if args.dir else [])
            + (["--backend", args.backend] if args.backend != "auto" else [])
            + (["--address", args.address] if args.address else [])
            + ({True: ["--stack-seeds"], False: ["--no-stack-seeds"]}.get(args.stack_seeds, []))
        )
        print(
            f"mappo: sweep interrupted; run `{again}` again to continue (finished trials are "
            "skipped, the others resume from their checkpoints)",
            file=sys.stderr,
        )
        return 128 + err.signum
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        print(f"mappo: trial {r.id} failed: {r.error}", file=sys.stderr)
    report = write_outputs(spec, sys.stdout)
    if report:
        print(report)
    if failed:
        print(
            f"mappo: {len(failed)} of {len(results)} trials failed (their error.txt has the "
            "traceback); fix the cause and run the same command to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


def _results(args: argparse.Namespace) -> tuple[list, list]:
    from mappo.experiments.runs import find_runs, group_runs

    runs = find_runs(args.dirs)
    return group_runs(runs), runs


def cmd_plot(args: argparse.Namespace) -> int:
    from mappo.experiments.plot import plot_curves

    if args.out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise config_mod.ConfigError(f"--out must name a .png, .pdf or .svg file, got '{args.out}'")
    from mappo.experiments.runs import default_metric

    configs, runs = _results(args)
    fig = plot_curves(configs, args.metric, args.x, out=args.out, title=args.title)
    # (configurations that do not log the metric were left out, with a warning)
    drawn = sum(len(ax.get_legend_handles_labels()[1]) for ax in fig.axes)
    plural = "s" if drawn != 1 else ""
    tasks: dict[str, list[str]] = {}  # metric -> its panels (each task's default metric)
    for ax in fig.axes:
        if ax.get_ylabel():
            tasks.setdefault(ax.get_ylabel(), []).append(ax.get_title())
    if len(tasks) > 1:
        what = "metrics " + ", ".join(f"{m} ({', '.join(t)})" for m, t in tasks.items())
    else:
        what = f"metric {next(iter(tasks), args.metric or default_metric(runs))}"
    print(f"wrote {args.out}: {drawn} configuration{plural}, {what} against {args.x}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from mappo.experiments.report import FORMATS, marl_eval, report_rows
    from mappo.experiments.runs import ResultsError

    configs, runs = _results(args)
    if args.marl_eval:
        _check_marl_eval_path(args.marl_eval, [run.dir for run in runs])
    if args.window is not None and args.target is None:
        raise ResultsError("--window needs --target (the level it judges)")
    window = 3 if args.window is None else args.window
    rows = report_rows(configs, args.metric, target=args.target, window=window)
    table = FORMATS[args.format](rows)
    if args.marl_eval:  # written first: an unwritable path fails before anything is printed
        if args.marl_eval.is_dir():
            raise ResultsError(
                f"--marl-eval names a file to write, and '{args.marl_eval}' is a folder; give "
                "a file name such as results.json"
            )
        args.marl_eval.write_text(
            json.dumps(marl_eval(configs, args.metric), indent=2), encoding="utf-8"
        )
    print(table)
    if args.marl_eval:
        print(f"wrote {args.marl_eval} (marl-eval raw-data JSON)", file=sys.stderr)
    return 0


def _check_marl_eval_path(path: Path, run_dirs: list[Path]) -> None:
    """Refuse a ``--marl-eval`` file that is not a .json file or lies inside a run directory
    being read: the write replaced whatever was there (a run's metrics.csv, summary.json or a
    checkpoint)."""
    from mappo.experiments.runs import ResultsError

    if path.suffix.lower() != ".json":
        raise ResultsError(f"--marl-eval must name a .json file, got '{path}'")
    target = path.resolve()
    for run_dir in run_dirs:
        if run_dir.resolve() in target.parents:
            raise ResultsError(
                f"--marl-eval '{path}' is inside the run directory '{run_dir}' being read; "
                "write it outside the runs, e.g. results.json"
            )


def _add_import(parser: argparse.ArgumentParser) -> None:
    """``--import MODULE``: modules of the user's that register environments, imported first."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module first: for the environments it registers with "
        "mappo.envs.register, or to let a saved run whose env name imports it "
        "(python:<module>:<class>, pettingzoo:<module>, gymnasium:<module>:<id>) import it "
        "(repeatable; the current directory is searched too)",
    )


def _import_modules(args: argparse.Namespace) -> None:
    """Import the ``--import`` modules; one that cannot be imported is an EnvError."""
    from mappo.envs.importing import require_module
    from mappo.envs.registry import trust_module

    for module in getattr(args, "imports", []):
        if module == "__main__":  # here that is the mappo command itself
            raise config_mod.ConfigError(
                "--import __main__ cannot reach the script that trained a run; open that run "
                "from a script that defines its env class, or move the class into a module "
                "and pass --import <module>"
            )
        require_module(f"--import {module}", module)
        trust_module(module)  # a saved run may name it (python:<module>:<class>, ...)


def _torch_version() -> str:
    """Torch's version as ``torch.__version__`` gives it (with its build, ``+cpu`` or
    ``+cu130``, which the package data of a PyPI wheel leaves out), read from its
    ``version.py`` as text so that ``--version`` stays quick and runs nothing of torch's."""
    import importlib.util
    from importlib import metadata
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        try:
            text = (Path(spec.origin).parent / "version.py").read_text()
        except OSError:
            text = ""
        found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
        if found:
            return found.group(1)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def _version() -> str:
    """``mappo X (torch Y, Python Z)``: what a bug report needs."""
    import platform

    from mappo import __version__

    return f"mappo {__version__} (torch {_torch_version()}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """``--version``: reads the versions only when asked (argparse's own takes the text when the
    parser is built, on every command)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **_: Any):
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the versions"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mappo", description="Multi-agent PPO: train, evaluate, render, benchmark.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a preset or YAML config, or resume a run")
    t.add_argument("config", nargs="?", help="preset name (mpe/simple_spread) or YAML path")
    t.add_argument(
        "overrides",
        nargs="*",
        help="KEY=VALUE overrides, e.g. algo.epochs=5 (a key given twice: the last value wins)",
    )
    t.add_argument(
        "--resume",
        nargs="+",
        metavar="RUN_DIR",
        help="continue a run from its last checkpoint (several run directories: seeds of one "
        "configuration continue together in one process)",
    )
    _add_import(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a trained run or checkpoint")
    e.add_argument("path", help="run directory or checkpoint file (a map with --scripted)")
    e.add_argument(
        "kwargs",
        nargs="*",
        help="env KEY=VALUE parameters that replace the run's for this evaluation "
        "(e.g. render_mode=rgb_array); the networks must still fit the env",
    )
    e.add_argument(
        "--episodes", type=_positive_int, default=32, help="evaluation episodes (default 32)"
    )
    e.add_argument(
        "--seed", type=_SEED, default=12345, help="seed of the evaluation's envs (default 12345)"
    )
    e.add_argument("--device", default="cpu")
    e.add_argument("--sample", action="store_true", help="sample actions instead of greedy")
    e.add_argument("--gif", type=Path, help="also render one episode to this GIF file")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument(
        "--scripted",
        action="store_true",
        help="evaluate the scripted baseline on PATH = smac/<map> (attack the closest enemy) "
        "or hanabi/<variant> (play what hints prove playable, hint playable cards, discard "
        "the oldest unhinted card)",
    )
    _add_import(e)
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("render", help="render an episode of random actions to a GIF")
    r.add_argument("env", help="environment name, e.g. mpe/simple_spread")
    r.add_argument("kwargs", nargs="*", help="environment KEY=VALUE parameters")
    r.add_argument("--gif", type=Path, required=True)
    r.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="stop after this many steps, or where the episode ends if sooner (default: the "
        "whole episode; one episode at most)",
    )
    r.add_argument("--seed", type=_SEED, default=0)
    _add_import(r)
    r.set_defaults(func=cmd_render)

    ls = sub.add_parser("list", help="presets and environments")
    ls.add_argument("--keys", action="store_true", help="list every config key instead")
    _add_import(ls)
    ls.set_defaults(func=cmd_list)

    sw = sub.add_parser(
        "sweep", help="run a grid of presets x overrides x seeds (resumable; Ray or serial)"
    )
    sw.add_argument("spec", help="sweep spec YAML, or a shipped spec such as paper/mpe")
    sw.add_argument("--dir", help="sweep directory (default: sweeps/<spec name>)")
    sw.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "ray", "serial"),
        help="ray (needs mappo[ray]), serial (one trial at a time here), auto: ray if installed",
    )
    sw.add_argument(
        "--address", help="Ray cluster to use: auto or HOST:PORT (default: a local Ray)"
    )
    sw.add_argument(
        "--max-concurrent",
        type=_nonnegative_int,
        default=None,
        metavar="N",
        help="trials at once (default: the spec's max_concurrent; 0: as resources allow)",
    )
    sw.add_argument(
        "--stack-seeds",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train the seeds of each configuration together in one process (num_seeds; "
        "MAPPO family), or not; default: the spec's stack_seeds",
    )
    sw.add_argument("--dry-run", action="store_true", help="list the trials and stop")
    sw.set_defaults(func=cmd_sweep)

    for name, helptext in (
        ("plot", "learning curves of run directories: mean and 95%% band over seeds"),
        (
            "report",
            "a table per configuration of run directories: final, best, IQM with CI, and the "
            "time to a --target",
        ),
    ):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("dirs", nargs="+", help="run directories or folders holding them")
        q.add_argument(
            "--metric",
            help="metrics.csv column, or its summary.json name (eval_return_mean) (default: "
            "eval/eval_battle_won if logged, else eval/eval_return_mean)",
        )
        if name == "plot":
            q.add_argument("--out", type=Path, required=True, help="figure file (.png/.pdf/.svg)")
            q.add_argument("--x", default="env_steps", choices=("env_steps", "wall_seconds"))
            q.add_argument("--title")
            q.set_defaults(func=cmd_plot)
        else:
            q.add_argument("--format", default="markdown", choices=("markdown", "csv", "json"))
            q.add_argument(
                "--marl-eval", type=Path, help="also write the runs as marl-eval raw-data JSON"
            )
            q.add_argument(
                "--target",
                type=_finite_float,
                help="a level of the metric (e.g. -120): when each seed first reached it, in env "
                "steps and wall seconds, judged by the mean of --window consecutive evaluations",
            )
            q.add_argument(
                "--window",
                type=int,
                help="evaluations averaged for --target (default 3)",
            )
            q.set_defaults(func=cmd_report)

    b = sub.add_parser("bench", help="throughput benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    be = bsub.add_parser("env", help="environment steps per second")
    be.add_argument("--envs", nargs="+", default=["mpe/simple_spread"])
    be.add_argument("--num-envs", nargs="+", type=_positive_int, default=[1, 128, 1024, 4096])
    be.add_argument("--seconds", type=_positive_float, default=2.0, help="timing per row")
    be.add_argument("--device", default="cpu")
    be.add_argument("--no-pettingzoo", action="store_true", help="skip the mpe2 reference row")
    be.add_argument(
        "--threads",
        type=_THREADS,
        default=1,
        help="torch threads for our rows (1, the default, is fastest for the particle worlds on "
        "2 cores; Hanabi at thousands of games gains from more; 0: torch's own count, every "
        "core; training's threads=0 follows the cores other processes leave free instead)",
    )
    be.add_argument(
        "--compile",
        action="store_true",
        help="also time the particle worlds with their steps compiled, eight to a graph",
    )
    be.add_argument(
        "--hanabi-backend",
        nargs="+",
        choices=["auto", "native", "torch"],
        default=["auto"],
        help="the Hanabi envs' backend(s): native (C, CPU), torch, or auto (native on a CPU "
        "where it builds); several give a row each",
    )
    be.add_argument("--json", action="store_true")
    _add_import(be)
    be.set_defaults(func=cmd_bench_env)
    bt = bsub.add_parser("train", help="training steps per second of a preset")
    bt.add_argument("config", nargs="?", default="mpe/simple_spread")
    bt.add_argument("overrides", nargs="*")
    bt.add_argument("--iterations", type=_positive_int, default=5)
    bt.add_argument(
        "--warmup",
        type=_nonnegative_int,
        default=1,
        metavar="N",
        help="iterations before the timed ones (default 1); QMIX, VDN and IQL also warm up "
        "until their replay buffer holds a batch, so that every timed iteration learns",
    )
    bt.add_argument("--json", action="store_true")
    _add_import(bt)
    bt.set_defaults(func=cmd_bench_train)
    return p


def _error(message: object) -> None:
    """Print ``mappo: error: <message>`` as one line (a message never spans lines)."""
    print("mappo: error: " + " ".join(str(message).split()), file=sys.stderr)


_FULL = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))
"""A full disk, a file-size limit, a disk quota."""


def _os_error(
    err: OSError,
    resuming: bool = False,
    overrides: list[str] | None = None,
    imported: list[str] | None = None,
) -> str:
    """One line for a failed read or write: what, where, and for a full disk, what is kept.
    ``resuming``: the command resumes a run, which writes into its own folder, with
    ``overrides`` (given again in the command to resume with: a checkpoint written before
    them does not hold them); ``imported``: the command's ``--import`` modules, which the
    resume needs as well."""
    reason = err.strerror or str(err)
    where = f": '{err.filename}'" if err.filename else ""
    extra = ""
    written = Path(err.filename) if err.filename else None
    if err.errno == errno.ENOSPC and written is not None and "checkpoints" in written.parts:
        earlier = [p for p in written.parent.glob("iter_*.pt") if p != written]
        extra = (
            "; a checkpoint is written whole or not at all, so those written before are "
            "intact: free space and resume"
            if earlier
            else "; the run had written no checkpoint yet: free space and start it again"
        )
    elif err.errno in _FULL and hasattr(err, "mappo_run"):
        dirs, newest = err.mappo_run
        words = shlex.join([*(str(d) for d in dirs), *(overrides or [] if resuming else [])])
        imports = "".join(f" --import {shlex.quote(m)}" for m in (imported or []))
        extra = (
            f"; the run keeps its checkpoints up to {Path(newest).name}: free space, then: "
            f"mappo train --resume {words}{imports or _import_option(Path(dirs[0]))}"
            if newest is not None
            else "; the run had written no checkpoint yet: free space and start it again"
        )
    elif err.errno == errno.ENOSPC:
        extra = "; free space and run the command again"
    elif err.errno in (errno.EPERM, errno.EACCES, errno.EROFS) and resuming:
        extra = (
            "; a resume writes into the run's folder: make it writable, or copy the run to a "
            "writable place and resume the copy"
        )
    elif err.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
        extra = "; choose a writable place"
    elif err.errno == errno.ENOENT:  # a file to read, or the folder of one to write
        extra = "; check the path (to write a file there, create its folder first)"
    return f"{reason}{where}{extra}"


def _import_option(run_dir: Path) -> str:
    """`` --import <module>`` where the run's env name imports a module (``python:...``), which
    a resume must be told to trust; else empty."""
    from mappo.envs.registry import imported_module

    try:
        module = imported_module(config_mod.load(str(run_dir / "config.yaml")).env.name)
    except Exception:  # the hint is best effort; the run's files are checked on resume
        return ""
    return f" --import {module}" if module else ""


def _memory_fix(args: argparse.Namespace) -> str:
    """What to lower when ``args``' command ran out of memory."""
    if args.command == "bench" and getattr(args, "num_envs", None) is not None:
        return "lower --num-envs"
    given = getattr(args, "kwargs", None)  # env parameters of eval and render (num_agents=...)
    params = f" or the env parameters given ({' '.join(given)})" if given else ""
    if args.command == "eval":
        return f"lower --episodes{params}"
    if args.command == "render":
        return (
            f"lower the env parameters given ({' '.join(given)})" if given else "draw a smaller env"
        )
    if _family(args) not in (None, "ppo"):  # (the replay buffer holds most of it)
        return "lower algo.buffer_size, env.num_envs or eval_episodes"
    return "lower env.num_envs or eval_episodes"


def _family(args: argparse.Namespace) -> str | None:
    """The algorithm family of the run ``args`` trains or resumes, where it can be read."""
    with contextlib.suppress(Exception):
        resumed = [d for d in getattr(args, "resume", None) or [] if Path(d).is_dir()]
        if resumed:
            return config_mod.load(str(Path(resumed[0]) / "config.yaml")).family
        if getattr(args, "config", None):
            return config_mod.load(args.config, getattr(args, "overrides", None) or []).family
    return None


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll's POLLERR on it)."""
    try:
        import select

        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLERR)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows) or no real stdout
        return False


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    # (without a library's terminal colours: Gymnasium colours its warnings' text)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(message))
    print("mappo: warning: " + " ".join(text.split()), file=sys.stderr)


def _quiet_writer_errors(
    args: threading.ExceptHookArgs, then: Callable[[threading.ExceptHookArgs], Any]
) -> None:
    """An OSError in TensorBoard's writer thread (a full disk) reaches the command's own thread
    at its next write, which reports it in one line: the thread's traceback is left out. Other
    threads' errors go to ``then``, the hook installed before the command's."""
    writer = type(args.thread).__module__.startswith("tensorboard.")
    if writer and isinstance(args.exc_value, OSError):
        return
    then(args)


def _command_parser(parser: argparse.ArgumentParser, func: Any) -> argparse.ArgumentParser:
    """The (sub)command's parser that runs ``func``, so that an error names its own help
    (``mappo bench env --help``); ``parser`` itself where none does."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if sub.get_default("func") is func and func is not None:
                    return sub
                found = _command_parser(sub, func)
                if found is not sub:
                    return found
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Imported after parsing, so that --help and a mistyped command answer without torch's
    # import (two to three seconds on a laptop); Ctrl-C during it is a stop like any other.
    try:
        from mappo.checkpoint import CheckpointError
        from mappo.envs.base import EnvError
        from mappo.experiments.runs import ResultsError
        from mappo.logging import MetricsError
        from mappo.trainer import RunInterrupted, TrainingDiverged
    except KeyboardInterrupt:
        print("mappo: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT

    # KEY=VALUE words after an option (`--import my_envs env.name=...`) are the same
    # overrides as before it; argparse only takes positional words before the first option.
    words = next(
        (w for w in ("overrides", "kwargs") if isinstance(getattr(args, w, None), list)), None
    )
    if extra and words and all("=" in w and not w.startswith("-") for w in extra):
        setattr(args, words, [*getattr(args, words), *extra])
    elif extra:
        _command_parser(parser, getattr(args, "func", None)).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    shown_before, hook_before = warnings.showwarning, threading.excepthook
    warnings.showwarning = _show_warning
    threading.excepthook = functools.partial(_quiet_writer_errors, then=hook_before)
    try:
        _import_modules(args)
        return args.func(args)
    except (config_mod.ConfigError, EnvError, CheckpointError, MetricsError, ResultsError) as err:
        if os.environ.get("MAPPO_DEBUG"):  # the traceback, for one's own env or code
            raise
        _error(err)
        return EXIT_USAGE
    except BrokenPipeError as err:
        if not _stdout_closed():  # a pipe of the command's own (a worker's) broke
            _error(_os_error(err))
            return EXIT_USAGE
        # The reader of the output went away (`mappo list | head`): stop quietly, as a tool
        # killed by SIGPIPE does, with nothing left for Python to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:
        resuming = bool(getattr(args, "resume", None))
        overrides = _resume_words(args)[1] if resuming else None
        _error(_os_error(err, resuming, overrides, getattr(args, "imports", None)))
        return EXIT_USAGE
    except TrainingDiverged as err:
        _error(err)
        return EXIT_DIVERGED
    except RunInterrupted as err:
        if err.checkpoint is None:
            kept = (
                "" if Path(err.run_dir).is_dir() else " (its folder, with nothing in it, removed)"
            )
            print(
                f"mappo: interrupted at env step {err.env_steps:,} before the first checkpoint "
                f"of '{err.run_dir}'; nothing to resume{kept}",
                file=sys.stderr,
            )
        else:
            dirs = shlex.join(str(d) for d in err.run_dirs)
            if err.evaluation_stopped:
                print(
                    f"mappo: interrupted during the final evaluation at env step "
                    f"{err.env_steps:,}; the trained run is saved in {err.checkpoint}; evaluate "
                    f"it with: mappo eval {shlex.quote(str(err.run_dir))}"
                    f"{_import_option(err.run_dir)}",
                    file=sys.stderr,
                )
                return 128 + err.signum
            if err.saved_at_stop:
                what = f"interrupted at env step {err.env_steps:,}; saved {err.checkpoint}"
                what += " and the other seeds' checkpoints" if len(err.run_dirs) > 1 else ""
            else:  # a second signal: stopped at once, nothing saved at the stop
                what = (
                    f"stopped at once (a second signal) in the iteration after env step "
                    f"{err.env_steps:,}, which is not kept; the newest checkpoint is "
                    f"{err.checkpoint}"
                )
            again = f"mappo train --resume {dirs}{_import_option(err.run_dir)}"
            print(f"mappo: {what}; continue with: {again}", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        print("mappo: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except MemoryError:
        _error(f"out of memory; {_memory_fix(args)}")
        return EXIT_USAGE
    except RuntimeError as err:
        from mappo.compiled import COMPILER_HINT, compiler_failure

        broken = compiler_failure(err)
        if broken is not None:  # compile=on (auto trains eagerly instead)
            _error(
                f"compiling needs a compiler that torch can build with: {broken}; "
                f"{COMPILER_HINT}, or run without compiling (compile=off)"
            )
            return EXIT_USAGE
        # Allocation failures of torch (CPU or GPU) surface as RuntimeErrors.
        if "alloc" not in str(err) and "out of memory" not in str(err):
            raise
        _error(f"out of memory ({str(err).strip().splitlines()[0][:160]}); {_memory_fix(args)}")
        return EXIT_USAGE
    finally:  # (a caller of main() in-process keeps its own hooks)
        warnings.showwarning, threading.excepthook = shown_before, hook_before


if __name__ == "__main__":
    sys.exit(main())
