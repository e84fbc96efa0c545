"""Sweeps: a grid of presets x overrides x seeds, each trial an ordinary run directory.

A spec (YAML, read with the safe loader) names what to run::

    name: spread_clip                     # default: the spec file's name
    presets: [mpe/simple_spread_fast, mpe/simple_spread_mappo]
    seeds: [1, 2, 3]                      # or a count: 3 means [1, 2, 3]
    overrides: {total_env_steps: 1000000} # applied to every trial
    grid: {algo.clip: [0.1, 0.2]}         # a cross product
    resources: {cpus: 1, gpus: 0}         # per trial (Ray); cpus also sets torch threads
    max_concurrent: 0                     # 0: as many as the resources allow
    stack_seeds: false                    # true: a configuration's seeds train in one process

Trial ``<preset>/<grid point>/seed<k>`` trains in ``<sweep dir>/<preset>/<grid point>/seed<k>/``.
What is on disk decides what a trial does, so a sweep is resumable by running it again: a trial
whose ``summary.json`` reached its budget is skipped, one with a checkpoint resumes from it (exact
on CPU), any other starts afresh. A failing trial writes ``error.txt`` (its traceback) and is
reported; the others go on. Trials run on Ray (an embedded local instance by default, or a
cluster's address) or one after another in this process (``backend="serial"``). On a cluster
the sweep directory must be on a filesystem every node sees (e.g. NFS), as trials write there.

With ``stack_seeds`` (or ``mappo sweep --stack-seeds``) the trials of one preset and grid point
that differ only in their seed run as one *unit*, one process training them together
(:func:`mappo.trainer.train_stacked`, as ``num_seeds`` does; MAPPO family only, the value family's
trials stay one per process). Each seed still writes its own ordinary trial folder, so a stacked
trial can be continued alone and an unstacked one with its siblings. A unit takes the spec's
``resources`` once (they are per process); seeds with checkpoints resume together in groups of
equal checkpoint iteration, and a group that fails is run again one trial at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mappo import config as config_mod
from mappo.experiments import runs as runs_mod
from mappo.experiments.runs import summary_steps
from mappo.experiments.spec import (  # noqa: F401  (the spec's names, for users of this module)
    SweepError,
    SweepSpec,
    Trial,
    check_unchanged,
    list_specs,
    load_spec,
)


@dataclass
class TrialResult:
    """What became of a trial in one invocation of the sweep."""

    id: str
    status: str
    """``done`` (trained now), ``skipped`` (finished before), ``failed`` or ``interrupted``."""
    env_steps: int = 0
    seconds: float = 0.0
    """Wall time of the trial in this invocation (start to end, env construction included)."""
    node: str = ""
    error: str = ""
    stop_signal: int | None = None
    """A stop signal that came while the trial ended (it finished): the sweep stops after it."""


# -- one trial --------------------------------------------------------------------------------


def trial_state(trial: Trial) -> str:
    """``finished`` (its summary reached the budget), ``partial`` (a checkpoint to resume
    from) or ``new``."""
    d = Path(trial.dir)
    summary = d / "summary.json"
    if summary.is_file():
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError, RecursionError):
            if (
                int(json.loads(summary.read_text(encoding="utf-8"))["env_steps"])
                >= trial.total_env_steps
            ):
                return "finished"
    if any((d / "checkpoints").glob("iter_*.pt")):
        return "partial"
    return "new"


# What a trial that starts afresh clears of an earlier attempt that never reached a checkpoint.
_LEFTOVERS = ("metrics.csv", "metrics.pending.csv", "config.yaml", "summary.json", "error.txt")


def _clear_leftovers(d: Path) -> None:
    for name in _LEFTOVERS:
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(d / "tensorboard", ignore_errors=True)


def node_name() -> str:
    """The Ray node this process runs on (its id), or the host name outside Ray."""
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


def _invisible(trial: Trial, node: str) -> TrialResult | None:
    """A ``failed`` result when this node cannot see the sweep directory, else None."""
    if trial.root.is_dir():
        return None
    return TrialResult(
        trial.id,
        "failed",
        node=node,
        error=f"the sweep directory is not visible on node {node}; put it on a filesystem "
        "every node of the cluster sees (e.g. NFS) and pass it with --dir",
    )


def run_trial(trial: Trial) -> TrialResult:
    """Train, resume or skip one trial, by what its directory holds; never raises for the
    trial's own failures (they come back as ``failed`` with the error, and ``error.txt``)."""
    from mappo.trainer import RunInterrupted, resume, train

    start = time.monotonic()
    d = Path(trial.dir)
    result = TrialResult(trial.id, "done", node=node_name())
    lost = _invisible(trial, result.node)
    if lost is not None:
        return lost
    state = trial_state(trial)
    if state == "finished":
        result.status = "skipped"
        result.env_steps = summary_steps(d)
        return result
    if state == "partial" and _reached_budget(trial):
        result.status = "skipped"
        result.env_steps = summary_steps(d)
        return result
    try:
        if state == "partial":
            _trust_spec_env(trial)
            run = resume(d, dict(trial.overrides))
        else:
            d.mkdir(parents=True, exist_ok=True)
            _clear_leftovers(d)
            run = train(
                config_mod.load(trial.preset, dict(trial.overrides), refuse_unread=False), run_dir=d
            )
        result.env_steps = int(run.summary.get("env_steps", 0))
        result.stop_signal = run.stop_signal
        (d / "error.txt").unlink(missing_ok=True)
    except RunInterrupted as err:
        result.status, result.env_steps = "interrupted", err.env_steps
        result.error = str(err)
    except Exception as err:  # the trial's failure is reported; the sweep goes on
        result.status = "failed"
        result.error = _failure(err, [trial])
    result.seconds = time.monotonic() - start
    return result


def _trust_spec_env(trial: Trial) -> None:
    """A trial resumes from its folder with the env the spec names (check_unchanged saw to
    that), so the module of a ``python:`` env name is the user's word, not only the folder's."""
    from mappo.envs.registry import imported_module, trust_module

    module = imported_module(
        config_mod.load(trial.preset, dict(trial.overrides), refuse_unread=False).env.name
    )
    if module is not None:
        trust_module(module)


def _failure(err: Exception, trials: list[Trial]) -> str:
    """The one-line error of failed trials; the traceback goes to each folder's error.txt,
    beside the trial's config.yaml where the run left none (one that failed before its first
    row removes its own), so that reports count the trial among its configuration's seeds."""
    trace = traceback.format_exc()
    for trial in trials:
        d = Path(trial.dir)
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            (d / "error.txt").write_text(trace, encoding="utf-8")
        if not (d / "config.yaml").exists():
            with contextlib.suppress(Exception):  # (a config that cannot load: the error says)
                cfg = config_mod.load(trial.preset, dict(trial.overrides), refuse_unread=False)
                config_mod.save(cfg, d / "config.yaml")
    return f"{type(err).__name__}: " + " ".join(str(err).split())


# -- units: the trials one process runs -------------------------------------------------------


def plan_units(trials: list[Trial], stack_seeds: bool) -> list[list[Trial]]:
    """The trials as units of work, in the trials' order: each trial alone, or with
    ``stack_seeds`` the MAPPO-family trials of one preset and grid point together."""
    if not stack_seeds:
        return [[t] for t in trials]
    units: dict[str, list[Trial]] = {}
    for t in trials:
        units.setdefault(t.id.rsplit("/", 1)[0] if t.family == "ppo" else t.id, []).append(t)
    return list(units.values())


def run_unit(trials: list[Trial]) -> list[TrialResult]:
    """Train, resume or skip the trials of one unit (:func:`plan_units`), one result per
    trial; never raises for the trials' own failures.

    One trial runs as :func:`run_trial`. Seeds of one configuration: finished ones are skipped,
    the new ones train together, those with checkpoints resume together, a group per checkpoint
    iteration (a group of one runs alone). A group that fails together (a seed diverging, a
    stack too large for the memory, an env error) is run again one trial at a time, so that one
    seed's failure is its own. Ctrl-C or SIGTERM stops the unit once the running group
    checkpointed; the trials it did not reach come back ``interrupted`` too."""
    if len(trials) == 1:
        return [run_trial(trials[0])]
    node = node_name()
    lost = [_invisible(t, node) for t in trials]
    if any(r is not None for r in lost):
        return [r for r in lost if r is not None]
    results: dict[str, TrialResult] = {}
    fresh: list[Trial] = []
    by_iteration: dict[int, list[Trial]] = {}
    for t in trials:
        state = trial_state(t)
        if state == "finished" or (state == "partial" and _reached_budget(t)):
            results[t.id] = TrialResult(t.id, "skipped", summary_steps(Path(t.dir)), node=node)
        elif state == "partial":
            by_iteration.setdefault(_checkpoint_iteration(t), []).append(t)
        else:
            fresh.append(t)
    groups = [(g, False) for g in [fresh] if g] + [(g, True) for g in by_iteration.values()]
    stop: str | None = None  # the signal that stops the unit, once one came
    try:
        for group, resuming in groups:
            done = _run_together(group, resuming) if len(group) > 1 else [run_trial(group[0])]
            if any(r.status == "failed" for r in done):
                done = []  # each trial's own fate, until a signal stops them
                for t in group:
                    done.append(run_trial(t))
                    if _signal_of(done[-1]):
                        break
            results.update((r.id, r) for r in done)
            stop = next((s for s in map(_signal_of, done) if s), None)
            if stop is not None:
                break  # the signal stops the sweep; the unit's other trials wait for a re-run
    except KeyboardInterrupt:  # between groups (a cancelled Ray task, Ctrl-C)
        stop = "SIGINT"
    for t in trials:
        if t.id not in results:
            results[t.id] = TrialResult(
                t.id,
                "interrupted",
                summary_steps(Path(t.dir)),
                node=node,
                error=f"not started ({stop or 'SIGINT'})",
            )
    return [results[t.id] for t in trials]


def _signal_of(result: TrialResult) -> str | None:
    """The name of the signal that stops the sweep at ``result``: the trial was interrupted, or
    a signal came in its last iteration (it finished); ``None`` without one."""
    if result.stop_signal:
        return signal.Signals(result.stop_signal).name
    if result.status == "interrupted":
        return "SIGTERM" if "SIGTERM" in result.error else "SIGINT"
    return None


def _checkpoint_iteration(trial: Trial) -> int:
    """The iteration of a trial's newest usable checkpoint (-1 when none can be read: the
    trial's own resume then reports why)."""
    from mappo.checkpoint import CheckpointError, load_latest

    try:
        return int(load_latest(trial.dir)[1]["progress"]["iteration"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return -1


def _run_together(group: list[Trial], resuming: bool) -> list[TrialResult]:
    """Seeds of one configuration trained (or resumed) together in this process."""
    from mappo.trainer import RunInterrupted, resume_seeds, train_stacked

    start = time.monotonic()
    node = node_name()
    dirs = [Path(t.dir) for t in group]
    status, steps, error = "done", [0] * len(group), ""
    signalled: int | None = None
    try:
        if resuming:
            # The seed is each run's own; the other overrides are the same for every seed.
            same = {k: v for k, v in group[0].overrides.items() if k != "seed"}
            _trust_spec_env(group[0])
            runs = resume_seeds(dirs, same)
        else:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
                _clear_leftovers(d)
            cfgs = [
                config_mod.load(t.preset, dict(t.overrides), refuse_unread=False) for t in group
            ]
            runs = train_stacked(cfgs, dirs)
        steps = [int(r.summary.get("env_steps", 0)) for r in runs]
        signalled = runs[0].stop_signal
        for d in dirs:
            (d / "error.txt").unlink(missing_ok=True)
    except RunInterrupted as err:
        status, steps, error = "interrupted", [err.env_steps] * len(group), str(err)
    except Exception as err:  # the unit's failure is every trial's in it; the sweep goes on
        status, error = "failed", _failure(err, group)
    seconds = time.monotonic() - start
    return [
        TrialResult(t.id, status, n, seconds, node, error, signalled)
        for t, n in zip(group, steps, strict=True)
    ]


def _reached_budget(trial: Trial) -> bool:
    """Whether a trial without a finished summary already trained its budget (killed between
    its final checkpoint and its summary, or a spec that lowered ``total_env_steps``); if so,
    a summary is written from the newest checkpoint so that the trial counts as finished."""
    from mappo.checkpoint import CheckpointError, load_latest

    d = Path(trial.dir)
    last = runs_mod.last_logged_step(d)
    if last is None or last < trial.total_env_steps:
        return False  # cheap test first: the checkpoint need not be read
    try:
        newest, ckpt = load_latest(d)
    except CheckpointError:
        return False
    steps = int(ckpt["progress"]["env_steps"])
    if steps < trial.total_env_steps:
        return False
    runs_mod.summary_from_checkpoint(d, newest, steps)
    return True


# -- the console table ------------------------------------------------------------------------


def _last_row(d: Path) -> dict[str, str]:
    """The newest row of a trial's metrics.csv (empty if none yet)."""
    try:
        with (d / "metrics.csv").open(encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    if len(lines) < 2:
        return {}
    return dict(zip(lines[0].split(","), lines[-1].split(","), strict=False))


class StatusTable:
    """The trials' status, env steps and latest returns on the console while a sweep runs.

    On a terminal the table is redrawn in place every ``every`` seconds; otherwise (a log file)
    each status change is one line and the whole table is printed every ``plain_every`` s."""

    def __init__(
        self, trials: list[Trial], stream: TextIO | None = None, plain_every: float = 60.0
    ) -> None:
        self.trials = trials
        self.status = {t.id: "pending" for t in trials}
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.plain_every = plain_every
        self._drawn = 0
        self._last_plain = time.monotonic()
        self._lock = threading.Lock()

    def set(self, trial_id: str, status: str, note: str = "") -> None:
        with self._lock:
            self.status[trial_id] = status
            if not self.tty:
                self.stream.write(
                    f"trial {trial_id}: {status}{' (' + note + ')' if note else ''}\n"
                )
                self.stream.flush()

    def render(self) -> str:
        width = max(len(t.id) for t in self.trials)
        lines = [f"{'trial':{width}s}  {'status':11s} {'env steps':>13s}  {'return':>9s}  eval"]
        for t in self.trials:
            row = _last_row(Path(t.dir)) if self.status[t.id] != "pending" else {}
            steps = row.get("env_steps", "")
            ret = row.get("train/episode_return", "")
            ev = row.get(runs_mod.WIN_RATE) or row.get(runs_mod.RETURN) or ""
            steps_txt = f"{int(float(steps)):,}/{t.total_env_steps:,}" if steps else ""
            lines.append(
                f"{t.id:{width}s}  {self.status[t.id]:11s} {steps_txt:>13s}  "
                f"{_short(ret):>9s}  {_short(ev)}"
            )
        return "\n".join(lines)

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            if self.tty:
                text = self.render()
                up = f"\x1b[{self._drawn}F" if self._drawn else ""
                self.stream.write(up + "\n".join(f"{ln}\x1b[K" for ln in text.split("\n")) + "\n")
                self._drawn = text.count("\n") + 1
            elif force or time.monotonic() - self._last_plain >= self.plain_every:
                self._last_plain = time.monotonic()
                self.stream.write(self.render() + "\n")
            self.stream.flush()


def _short(text: str) -> str:
    try:
        return f"{float(text):.2f}"
    except ValueError:
        return ""


@contextlib.contextmanager
def _refreshing(table: StatusTable, every: float = 2.0) -> Iterator[None]:
    """Refresh ``table`` from a background thread while the body runs (the serial backend
    trains in the main thread, which keeps the trainer's Ctrl-C handling)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            table.refresh()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# -- backends ---------------------------------------------------------------------------------


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the sweep; running trials checkpointed where they could."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


def _run_serial(units: list[list[Trial]], table: StatusTable, results: list[TrialResult]) -> None:
    """One unit after another in this process (the trainer handles Ctrl-C and SIGTERM: the
    running trials checkpoint and the sweep stops)."""
    with _refreshing(table):
        for unit in units:
            for trial in unit:
                table.set(trial.id, "running")
            done = run_unit(unit)
            for result in done:
                table.set(result.id, result.status, result.error)
            results.extend(done)
            # (a signal in a trial's last iteration let the trial finish; it still stops the
            # sweep, as the "stopping after this iteration" it printed said)
            first = next((r for r in done if _signal_of(r)), None)
            if first is None:
                continue
            stopped = any(r.status == "interrupted" for r in done)
            if stopped or unit is not units[-1]:
                name = _signal_of(first)
                message = (
                    first.error
                    if first.status == "interrupted"
                    else f"{name} came in the last iteration of {first.id}, which finished"
                )
                raise SweepInterrupted(message, getattr(signal, str(name)))


def _ray_init(address: str | None) -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError(
            "the ray backend needs Ray: pip install 'mappo[ray]', or run with --backend serial"
        ) from None
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
    }
    if address and address != "auto" and not re.fullmatch(r"(ray://)?[\w.\-]+:\d{1,5}", address):
        raise SweepError(
            f"--address must be 'auto' or HOST:PORT (e.g. 10.0.0.5:6379), got {address!r}"
        )
    # "local" starts a fresh instance even where a `ray start` cluster runs on this machine.
    kwargs["address"] = address or "local"
    if not address:
        # Ray starts its workers at nice 15, which starves trials beside any other busy process
        # on the machine (measured: 3 s of training took 90 s beside two busy processes). A
        # trial is the sweep's main work, so the embedded instance runs them at normal priority;
        # on a cluster, start the nodes with RAY_worker_niceness=0 for the same.
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(**kwargs)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as err:
        first = " ".join(str(err).split())[:200]
        raise SweepError(f"cannot start or reach Ray at '{address or 'local'}': {first}") from None
    return ray


def _collect(ray: Any, ref: Any, unit: list[Trial]) -> list[TrialResult]:
    try:
        return ray.get(ref)
    except Exception as err:  # the worker died (killed, out of memory) or the task was cancelled
        first = " ".join(str(err).split())[:300]
        results = []
        for trial in unit:
            if trial_state(trial) == "finished":  # a group of the unit that ended before
                results.append(TrialResult(trial.id, "done", summary_steps(Path(trial.dir))))
                continue
            with contextlib.suppress(OSError):
                Path(trial.dir).mkdir(parents=True, exist_ok=True)
                (Path(trial.dir) / "error.txt").write_text(
                    f"the Ray worker was lost:\n{err}\n", encoding="utf-8"
                )
            results.append(TrialResult(trial.id, "failed", error=f"worker lost: {first}"))
        return results


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C (but exiting with SIGTERM's status)."""


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM stop the Ray driver as Ctrl-C does (trials asked to checkpoint first).
    SIGINT's handler is set explicitly, as the trainer sets its own: a process started in the
    background by a non-interactive shell (``mappo sweep ... &`` in a script, a test runner
    launched so) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, handler),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)


def _trials_that_fit(nodes: list[dict[str, Any]], cpus: float, gpus: float) -> int:
    """How many trials of ``cpus`` CPUs and ``gpus`` GPUs the alive nodes hold at once (a trial
    runs on one node, so capacity is counted node by node)."""
    total = 0
    for node in nodes:
        if not node.get("Alive", False):
            continue
        res = node.get("Resources", {})
        fit = int(res.get("CPU", 0) // cpus) if cpus else 1_000_000
        if gpus:
            fit = min(fit, int(res.get("GPU", 0) // gpus))
        total += fit
    return total


def _run_ray(
    units: list[list[Trial]],
    spec: SweepSpec,
    table: StatusTable,
    address: str | None,
    max_concurrent: int,
    results: list[TrialResult],
) -> None:
    """Each unit a Ray task with the spec's resources, at most as many at once as fit."""
    ray = _ray_init(address)
    running: dict[Any, list[Trial]] = {}
    try:
        with _signals_as_interrupt():
            task = ray.remote(run_unit).options(
                num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=0
            )
            cluster = ray.cluster_resources()
            fits = _trials_that_fit(ray.nodes(), spec.cpus, spec.gpus)
            if fits < 1:
                raise SweepError(
                    f"the Ray cluster has no room for a trial's {spec.cpus:g} CPUs and "
                    f"{spec.gpus:g} GPUs (it has {cluster.get('CPU', 0):g} CPUs, "
                    f"{cluster.get('GPU', 0):g} GPUs); lower 'resources' in the spec"
                )
            slots = min(fits, max_concurrent) if max_concurrent else fits
            pending = list(units)
            while pending or running:
                while pending and len(running) < slots:
                    unit = pending.pop(0)
                    running[task.remote(unit)] = unit
                    for trial in unit:
                        table.set(trial.id, "running")
                ready, _ = ray.wait(list(running), num_returns=1, timeout=2.0)
                for ref in ready:
                    for result in _collect(ray, ref, running.pop(ref)):
                        results.append(result)
                        table.set(result.id, result.status, result.error)
                table.refresh()
    except KeyboardInterrupt as err:
        # Cancelling a running task raises KeyboardInterrupt in its worker, which the trainer
        # takes as Ctrl-C: it finishes its update and checkpoints. Wait for that, briefly.
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        with contextlib.suppress(Exception, KeyboardInterrupt):
            ray.wait(list(running), num_returns=len(running), timeout=60)
        for ref, unit in running.items():
            for result in _collect(ray, ref, unit):
                if result.status == "failed" and "worker lost" in result.error:
                    result.status = "interrupted"
                results.append(result)
                table.set(result.id, result.status, result.error)  # shown as the sweep ends
        signum = signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT
        raise SweepInterrupted("interrupted", signum) from None
    finally:
        ray.shutdown()


BACKENDS = ("auto", "ray", "serial")


def run_sweep(
    spec: SweepSpec,
    backend: str = "auto",
    address: str | None = None,
    max_concurrent: int | None = None,
    stream: TextIO | None = None,
) -> list[TrialResult]:
    """Run (or continue) every trial of ``spec``; returns one result per trial and writes
    ``sweep.json``, ``report.md`` and, where matplotlib is installed, ``curves.png`` into the
    sweep directory. ``backend="auto"`` is Ray when it is installed, else serial."""
    if backend not in BACKENDS:
        raise SweepError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        try:
            import ray  # noqa: F401

            backend = "ray"
        except ImportError:
            backend = "serial"
    if address and backend != "ray":
        raise SweepError("--address needs the ray backend (pip install 'mappo[ray]')")
    if backend == "ray" and spec.gpus == 0:
        on_gpu = next(
            (t for t in spec.trials if "cuda" in str(t.overrides.get("device", ""))), None
        )
        if on_gpu is not None:
            raise SweepError(
                f"trial {on_gpu.id} trains on a GPU but 'resources.gpus' is 0, and Ray hides the "
                "GPUs from tasks that ask for none; set resources: {gpus: 1} (or 0.5, ...)"
            )
    check_folder(spec)
    from mappo.trainer import hold_lock

    root = sweep_root(spec)
    root.mkdir(parents=True, exist_ok=True)
    with hold_lock(root, "sweep"):
        return _run_locked(spec, root, backend, address, max_concurrent, stream)


def check_folder(spec: SweepSpec) -> None:
    """What the sweep directory already holds, checked against ``spec`` before anything runs
    (also by ``--dry-run``): not another sweep, and no trial trained with other settings."""
    _check_same_sweep(spec, sweep_root(spec))
    for trial in spec.trials:
        check_unchanged(trial)


FINISHED = "finished, skipped"
"""What :func:`trial_plan` says of a trial the sweep would skip."""


def trial_plan(trial: Trial) -> str:
    """What running the sweep would do with ``trial`` now, as ``--dry-run`` lists it (reading
    only: a trial that logged its whole budget counts as finished, as the sweep would find)."""
    state = trial_state(trial)
    if state == "partial":
        last = runs_mod.last_logged_step(Path(trial.dir))
        if last is not None and last >= trial.total_env_steps:
            state = "finished"
    if state == "finished":
        return FINISHED
    return "resumes from its checkpoint" if state == "partial" else "new"


def _check_same_sweep(spec: SweepSpec, root: Path) -> None:
    """Refuse a sweep directory that holds another sweep (its ``sweep.json`` names another):
    its record would be replaced and its runs reported under this sweep's name."""
    try:
        earlier = json.loads((root / "sweep.json").read_text(encoding="utf-8")).get("name")
    except (OSError, ValueError, AttributeError, RecursionError):
        return  # no sweep there yet, or no readable record of one
    if isinstance(earlier, str) and earlier != spec.name:
        raise SweepError(
            f"'{root}' holds the sweep '{earlier}'; give this sweep ('{spec.name}') another "
            "--dir, or run that sweep's own spec there"
        )


def _run_locked(
    spec: SweepSpec,
    root: Path,
    backend: str,
    address: str | None,
    max_concurrent: int | None,
    stream: TextIO | None,
) -> list[TrialResult]:
    out = stream or sys.stdout
    table = StatusTable(spec.trials, out)
    todo = []
    skipped = []
    for trial in spec.trials:
        if trial_state(trial) == "finished":
            table.status[trial.id] = "skipped"
            skipped.append(TrialResult(trial.id, "skipped", summary_steps(Path(trial.dir))))
        else:
            todo.append(trial)
    units = plan_units(todo, spec.stack_seeds)
    together = ""
    if len(units) < len(todo):
        together = f" ({len(units)} process{'es' if len(units) > 1 else ''}, seeds stacked)"
    out.write(
        f"sweep '{spec.name}' in {root}: {len(spec.trials)} trials, {len(skipped)} finished "
        f"before, {len(todo)} to run on {backend}{together}\n"
    )
    concurrency = spec.max_concurrent if max_concurrent is None else max_concurrent
    started = time.monotonic()
    results: list[TrialResult] = []
    try:
        if todo and backend == "ray":
            _run_ray(units, spec, table, address, concurrency, results)
        elif todo:
            _run_serial(units, table, results)
    finally:
        _write_status(spec, root, skipped + results, time.monotonic() - started, backend)
    table.refresh(force=True)
    return skipped + results


def sweep_root(spec: SweepSpec) -> Path:
    """The sweep directory (the common parent of its trials' folders)."""
    return spec.trials[0].root


def _write_status(
    spec: SweepSpec, root: Path, results: list[TrialResult], seconds: float, backend: str
) -> None:
    by_id = {r.id: r for r in results}
    status = {
        "name": spec.name,
        "backend": backend,
        "seconds": seconds,
        "trials": [
            {
                "id": t.id,
                "dir": t.dir,
                **dataclasses.asdict(by_id.get(t.id, TrialResult(t.id, "pending"))),
            }
            for t in spec.trials
        ],
    }
    tmp = root / "sweep.json.tmp"
    tmp.write_text(json.dumps(status, indent=2), encoding="utf-8")
    tmp.replace(root / "sweep.json")


def write_outputs(spec: SweepSpec, stream: TextIO | None = None) -> str | None:
    """The sweep's ``report.md`` and ``curves.png`` over its trials that logged evaluations;
    returns the report text (None when there is nothing to report yet). A metric no trial
    logs is a warning here, not an error: the trials' results are on disk either way."""
    from mappo.experiments.plot import plot_curves
    from mappo.experiments.report import format_markdown, report_rows

    root = sweep_root(spec)
    try:
        runs = runs_mod.find_runs([root])
        configs = runs_mod.group_runs(runs)
        text = format_markdown(report_rows(configs, spec.metric or None))
    except runs_mod.ResultsError as err:
        warnings.warn(f"no report for sweep '{spec.name}': {err}", stacklevel=2)
        return None
    about = f"{spec.description}\n\n" if spec.description else ""
    (root / "report.md").write_text(f"# Sweep {spec.name}\n\n{about}{text}\n", encoding="utf-8")
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        if stream is not None:
            stream.write("(no curves.png: pip install 'mappo[plot]' for plots)\n")
        return text
    try:
        figure = plot_curves(configs, spec.metric or None, out=root / "curves.png", title=spec.name)
        plt.close(figure)
    except runs_mod.ResultsError as err:
        warnings.warn(f"no curves.png for sweep '{spec.name}': {err}", stacklevel=2)
    return text
