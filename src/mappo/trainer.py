"""The training loop: collect -> returns -> update -> log / evaluate / checkpoint.

A run directory ``runs/<task>/<algo>/<time>_seed<k>/`` holds the resolved ``config.yaml``,
``metrics.csv``, TensorBoard events, ``checkpoints/`` (everything needed to resume exactly: model,
optimisers, normalisers, RNG states, env state, counters) and ``summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mappo import config as config_mod
from mappo.checkpoint import (  # noqa: F401 - re-exported: part of the trainer's interface
    FORMAT,
    CheckpointError,
    first_nonfinite,
    latest_checkpoint,
    load_checkpoint,
    load_latest,
    save_rotating,
    tidy_for_resume,
)
from mappo.config import TrainConfig
from mappo.data import library_defaults, spec_difference, spec_to_dict
from mappo.envs.base import BatchedEnv, EnvError, explained, is_users_env
from mappo.envs.registry import (
    copy_bytes,
    fit_workers,
    from_saved,
    imported_module,
    trust_module,
    uses_workers,
)
from mappo.envs.registry import make as make_env
from mappo.evaluation import EvaluationStopped, evaluate
from mappo.learners import Learner, make_learner
from mappo.logging import MetricsLogger, ProgressBar
from mappo.resources import (
    ThreadGovernor,
    available_bytes,
    bf16_is_emulated,
    env_state_bytes,
    evaluation_memory_problem,
    format_bytes,
    memory_problem,
)

_EVAL_SEED_OFFSET = 1_000_003
# A thread count the user set for the whole process wins over the governor.
_THREADS_FROM_ENV = any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
# Adapter envs run in worker processes: a probe for the memory estimate starts one, so they are
# probed only where the env count could plausibly exhaust memory.
_PROBE_ADAPTERS_ABOVE = 4096


class TrainingDiverged(RuntimeError):
    """A loss, gradient norm or parameter became NaN or inf; no checkpoint was written after it."""


class RunInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint (or before any could be)."""

    def __init__(
        self,
        signum: int,
        run_dir: Path,
        env_steps: int,
        checkpoint: Path | None,
        others: list[Path] | None = None,
        saved_at_stop: bool = True,
        evaluation_stopped: bool = False,
    ) -> None:
        self.signum = signum
        # True: the signal came during the final evaluation; training is complete and saved
        self.evaluation_stopped = evaluation_stopped
        self.run_dir = run_dir
        self.env_steps = env_steps
        self.checkpoint = checkpoint
        # False: a second signal stopped the run at once, so ``checkpoint`` is an older one
        self.saved_at_stop = saved_at_stop
        self.run_dirs = [run_dir, *(others or [])]
        """Every run stopped by the signal (the seeds of a stacked run)."""
        super().__init__(f"interrupted by {signal.Signals(signum).name} at env step {env_steps}")


@dataclass
class Run:
    """The result of :func:`train`: where it was written and what it reached."""

    dir: Path
    config: TrainConfig
    summary: dict[str, Any]
    policy: Any = field(repr=False)
    """The trained networks (an :class:`~mappo.nn.actor_critic.ActorCritic` for mappo, a
    :class:`~mappo.nn.q_agents.QNetworks` for the value family); to act with them, take
    :meth:`load_policy`."""
    stop_signal: int | None = None
    """A stop signal (SIGINT, SIGTERM) that came in the run's last iteration: the run finished
    anyway, but a caller with more to run (a sweep's next trial) should stop too."""

    def metrics(self) -> dict[str, Any]:
        """The run's ``metrics.csv`` read back: each column as a float array ``[rows]``, NaN
        where a row has no value (``pandas.DataFrame(run.metrics())`` makes a table of it)."""
        from mappo.experiments.runs import read_run

        if not (self.dir / "metrics.csv").is_file():  # stopped before its first logged row
            return {}
        return read_run(self.dir).columns

    def load_policy(self, device: str | torch.device = "cpu") -> Any:
        """The run's policy to act with, a :class:`mappo.Policy` (``act(observations)``): its
        newest checkpoint loaded, as :func:`mappo.load_policy` does."""
        from mappo.api import load_policy

        return load_policy(self.dir, device=device)


def _task_dir(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.replace(":", "/"))


class Trainer:
    """One training run of any algorithm family: the environments, the family's learner (which
    owns the networks, optimisers and data collection), the counters and the run directory.

    The loop (log, evaluate, checkpoint) is the same for every family; what one iteration does
    is the learner's (:mod:`mappo.learners`).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path | None = None,
        checkpoint: dict[str, Any] | None = None,
        env: BatchedEnv | None = None,
        learner: Learner | None = None,
        governor: bool = True,
    ) -> None:
        """``env`` and ``learner`` given together: a run whose learner was built elsewhere (one
        seed of a stacked run, :func:`train_seeds`); otherwise both are made from ``cfg``.
        ``governor=False`` leaves the process's thread count to another run (the first seed's)."""
        if (env is None) != (learner is None):
            raise ValueError("give both env and learner, or neither")
        self.cfg = cfg
        self.governor: ThreadGovernor | None = None
        # The caller's thread count, given back on close by the run that sets it (a stacked
        # run's first seed; the others find it set already).
        self._threads_before = torch.get_num_threads() if governor else None
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        elif (
            governor and config_mod.check_device(cfg.device).type == "cpu" and not _THREADS_FROM_ENV
        ):
            self.governor = ThreadGovernor()
        device = config_mod.check_device(cfg.device)
        if cfg.model.precision == "bf16" and bf16_is_emulated(device):
            warnings.warn(
                f"model.precision=bf16 on {_bf16_device(device)}: torch emulates bfloat16 "
                "products here, many times slower than float32; set model.precision=fp32",
                stacklevel=2,
            )
        probed = True
        if env is None:
            probed = _check_memory(cfg, device)
            env = make_env(
                cfg.env.name,
                num_envs=cfg.env.num_envs,
                device=device,
                seed=cfg.seed,
                **cfg.env.kwargs,
            )
        self.env = env
        try:
            self.eval_env = make_env(
                cfg.env.name,
                num_envs=cfg.eval_episodes,
                device=device,
                seed=cfg.seed + _EVAL_SEED_OFFSET,
                **fit_workers(cfg.env.kwargs, cfg.eval_episodes),
            )
        except BaseException:
            env.close()
            raise
        self.device = self.env.device
        if checkpoint is not None and "spec" in checkpoint:
            problem = spec_difference(checkpoint["spec"], self.env.spec)
            if problem is not None:
                self.close()
                raise EnvError(
                    f"the env '{cfg.env.name}' is not the one the run was trained on "
                    f"({problem}); resume with the env's code and parameters of the training"
                )
        if learner is None:
            try:
                _check_before_networks(cfg, self.env, device, probed)
            except BaseException:
                self.close()
                raise
        self.learner: Learner = learner if learner is not None else make_learner(cfg, self.env)
        self.iteration = 0
        self.env_steps = 0
        self.wall_offset = 0.0
        self.out_of_time = False
        self.timing_offset: dict[str, float] = {}
        """The rollout's and the update's seconds up to the checkpoint resumed from: the
        ``time/`` columns are totals over the whole run, as ``wall_seconds`` is."""
        self.eval_count = 0
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}
        self.error_prefix = ""
        """Names the run in errors where several train together (``seed 3: ``)."""
        self.eval_stoppable = False
        """Whether a stop signal gives up an evaluation under way, periodic or final (a single
        run's loop sets it; stacked seeds keep theirs, so that every seed saves the same
        iteration)."""
        self.final_eval_stopped = False
        """Whether a signal gave up the final evaluation (the run's training is complete)."""
        self.stop_signal: int | None = None
        """Set (by a signal handler) to stop after the current iteration with a checkpoint."""
        self.last_checkpoint: Path | None = None
        self.saved_iteration = -1  # the iteration of the checkpoint this process saved last
        self._alive_checked = False
        if checkpoint is not None:
            self._restore(checkpoint)
        self.run_dir = run_dir
        self.caller_folder = False
        """Whether ``run_dir`` is a folder that existed before this run (a caller's): never
        removed when the run stops before training (:func:`_remove_unstarted`)."""
        self.stacked_dirs: list[Path] = []  # every seed's folder, where this is a stacked seed

    @property
    def policy(self) -> Any:
        """The learner's networks (what acts, and what a checkpoint's ``policy`` holds)."""
        return self.learner.policy

    @property
    def collector(self) -> Any:
        """The learner's data collector."""
        return self.learner.collector

    # -- one iteration ------------------------------------------------------------------------
    def iterate(self) -> dict[str, float]:
        """One iteration of the learner (collect, then update); returns timings and losses."""
        return self.count(self.learn())

    def learn(self) -> dict[str, float]:
        """The learner's iteration, without counting it; a failure that the env's last output
        explains is that output's error (:func:`~mappo.envs.base.explained`)."""
        return explained([self.env], lambda: self.learner.iterate(self.iteration, self.env_steps))

    def count(self, result: dict[str, float]) -> dict[str, float]:
        """Advance the counters by an iteration's ``result`` (whose ``env_steps`` it takes)."""
        self.iteration += 1
        self.env_steps += int(result.pop("env_steps"))
        return result

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, wall_seconds: float, periodic: bool = False) -> dict[str, Any]:
        """The whole run: config, env spec, counters and the learner's own state (a periodic
        checkpoint may leave out what the learner allows, e.g. a large replay buffer)."""
        return {
            "format": FORMAT,
            "config": config_mod.to_dict(self.cfg),
            "spec": spec_to_dict(self.env.spec),
            "progress": {
                "iteration": self.iteration,
                "env_steps": self.env_steps,
                "wall_seconds": wall_seconds,
                "timings": dict(getattr(self, "_timings", self.timing_offset)),
                "eval_count": self.eval_count,
                "last_eval": self.last_eval,
                "last_train": self.last_train,
            },
            "learner": self.learner.state_dict(periodic=periodic),
        }

    def _restore(self, ckpt: dict[str, Any]) -> None:
        self.restore_progress(ckpt)
        self.learner.load_state_dict(ckpt["learner"], self.iteration)

    def restore_progress(self, ckpt: dict[str, Any]) -> None:
        """The counters of a checkpoint (the learner's state is restored by its owner)."""
        progress = ckpt["progress"]
        self.iteration = int(progress["iteration"])
        self.env_steps = int(progress["env_steps"])
        self.wall_offset = float(progress["wall_seconds"])
        # (absent from checkpoints written before the totals were kept: they restart at 0)
        self.timing_offset = {k: float(v) for k, v in progress.get("timings", {}).items()}
        self.eval_count = int(progress["eval_count"])
        self.last_eval = dict(progress["last_eval"])
        # (the progress line's and summary.json's training return; absent from older ones)
        self.last_train = dict(progress.get("last_train", {}))

    def save_checkpoint(self, wall_seconds: float, periodic: bool = False) -> Path:
        assert self.run_dir is not None
        self.last_checkpoint = save_rotating(
            self.state_dict(wall_seconds, periodic),
            self.run_dir,
            self.iteration,
            self.cfg.keep_checkpoints,
        )
        self.saved_iteration = self.iteration
        return self.last_checkpoint

    def check_finite(self, result: dict[str, float]) -> None:
        """Raise :class:`TrainingDiverged` if a loss or gradient norm of the last iteration, or
        a parameter or buffer of the networks, is NaN or inf (before anything is saved)."""
        what = next((f"loss/{k} = {v}" for k, v in result.items() if not math.isfinite(v)), None)
        if what is None:
            name = first_nonfinite(self.policy.state_dict())
            what = None if name is None else f"parameter '{name}' is not finite"
        if what is None:
            return
        kept = (
            f"the newest checkpoint, {self.last_checkpoint}, is finite and kept"
            if self.last_checkpoint is not None
            else "no checkpoint was written before it"
        )
        source = self._nonfinite_rollout()
        if source is not None:
            # not the optimiser: lower learning rates cannot help
            raise TrainingDiverged(
                f"{self.error_prefix}training diverged in update {self.iteration} (env step "
                f"{self.env_steps:,}): {what}, because the env returned NaN or inf ({source}) "
                f"in this iteration's rollout; {kept}. Fix the env's outputs"
            )
        clip = (
            ""
            if getattr(self.cfg.algo, "max_grad_norm", 0) is not None
            else " (or set max_grad_norm)"
        )
        then = "resume or start again" if self.last_checkpoint is not None else "start again"
        raise TrainingDiverged(
            f"{self.error_prefix}training diverged in update {self.iteration} "
            f"(env step {self.env_steps:,}): {what}; {kept}. Lower the learning rates{clip} "
            f"and {then}"
        )

    def check_episodes_end(self) -> None:
        """After each iteration, for a user's env: refuse episodes that have run past
        ``spec.episode_limit`` (an env that never ends them trained its whole budget before,
        to fail at the first evaluation, which waits for every episode to end)."""
        limit = self.env.spec.episode_limit
        lengths = getattr(self.learner.tracker, "lengths", None)
        if not limit or not isinstance(lengths, torch.Tensor) or not is_users_env(self.env):
            return
        longest = int(lengths.max())
        if longest > limit:
            raise EnvError(
                f"{self.env.name}: an episode has run {longest:,} steps, past "
                f"spec.episode_limit={limit:,}; end each episode by its limit (truncated=True "
                "on the step that reaches it), or declare a larger episode_limit"
            )

    def check_someone_alive(self) -> None:
        """Once per process, after the first rollout: warn of a group none of whose agents was
        alive in any step (an env that never sets ``alive``): MAPPO's losses skip agents that
        are not alive (``algo.policy_active_masks``, ``algo.value_active_masks``), so the
        group's networks would learn nothing while the run looks healthy. Stacked seeds share
        one rollout, checked by the first seed's trainer."""
        if self._alive_checked:
            return
        self._alive_checked = True
        learner: Any = self.learner
        collector = getattr(learner, "collector", None)
        if collector is None and getattr(learner, "k", None) == 0:
            collector = getattr(getattr(learner, "stack", None), "collector", None)
        rollout = getattr(collector, "rollout", None)
        # (the value family and COMA keep no such rollout, and their configs no active masks)
        algo = self.cfg.algo
        untrained = [
            what
            for what, key in (("policy", "policy_active_masks"), ("critic", "value_active_masks"))
            if getattr(algo, key, False)
        ]
        for name, buf in getattr(rollout, "groups", {}).items():
            alive = getattr(buf, "alive", None)
            if untrained and isinstance(alive, torch.Tensor) and alive.numel():
                if not bool(alive.any()):
                    steps, envs = alive.shape[:2]
                    warnings.warn(
                        f"{self.error_prefix}no agent of group '{name}' was alive in any of the "
                        f"first rollout's {steps} steps in {envs} envs, so the losses, which "
                        f"skip agents that are not alive, leave its {' and '.join(untrained)} "
                        "untrained; the env should return alive=True for the agents that act",
                        stacklevel=2,
                    )

    def _nonfinite_rollout(self) -> str | None:
        """Which of the last rollout's observations or rewards hold NaN or inf (``"obs of
        group 'g'"``), where the learner keeps such a rollout (MAPPO's); else None. The values
        of truncated episodes' final observations count too: the networks were finite when
        they computed them, so a NaN there came from the env's final_obs or final_state."""
        last = getattr(self.learner, "last_rollout", None)  # (MAPPO's learners and seeds)
        rollout = last() if last is not None else None
        parts = {
            "obs": "obs",
            "critic_x": "state",  # (the critic's input; obs, checked first, were finite)
            "rewards": "rewards",
            "final_values": "final_obs or final_state",
        }
        for name, buf in getattr(rollout, "groups", {}).items():
            for part, said in parts.items():
                x = getattr(buf, part, None)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    if not bool(x.isfinite().all()):
                        return f"{said} of group '{name}'"
        return None

    def close(self) -> None:
        """Release the environments' resources (worker processes of adapted envs) and give
        back the caller's torch thread count."""
        self.env.close()
        self.eval_env.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    # -- the loop -----------------------------------------------------------------------------
    def evaluate(self, stoppable: bool = False) -> dict[str, float]:
        """A greedy evaluation. ``stoppable`` (a periodic one of a single run's training): a
        stop signal that arrives while it runs gives it up
        (:class:`~mappo.evaluation.EvaluationStopped`) rather than waiting for its episodes."""
        self.policy.eval()
        stop = None
        if stoppable and self.eval_stoppable and self.stop_signal is None:
            stop = lambda: self.stop_signal is not None  # noqa: E731
        # Counted before it runs: one given up by a signal keeps its seed, so that the
        # evaluations after a resume draw the seeds of the uninterrupted run's.
        count, self.eval_count = self.eval_count, self.eval_count + 1
        result = evaluate(
            self.policy, self.eval_env, seed=self.cfg.seed + _EVAL_SEED_OFFSET + count, stop=stop
        )
        self.last_eval = result
        return result

    @property
    def done(self) -> bool:
        """Whether the run reached ``total_env_steps``, or this command's ``max_wall_seconds``
        (:attr:`out_of_time`, set once per iteration by the loop, for every stacked seed)."""
        return self.out_of_time or self.env_steps >= self.cfg.total_env_steps

    def begin(self) -> None:
        """Start the clocks of :meth:`after_iteration` and :meth:`finish` (the loop that calls
        them, for one run or the seeds of a stacked run, is :func:`_run`)."""
        self._start = time.perf_counter() - self.wall_offset
        self._steps_at_start, self._time_at_start = self.env_steps, time.perf_counter()
        self._timings = {
            k: self.timing_offset.get(k, 0.0) for k in ("rollout_seconds", "update_seconds")
        }

    def after_iteration(
        self,
        result: dict[str, float],
        logger: MetricsLogger | None = None,
        progress: ProgressBar | None = None,
        stopping: bool = False,
    ) -> bool:
        """Everything after an iteration's update (whose ``result`` passed
        :meth:`check_finite`): logging, evaluation and checkpoints. ``stopping``: a signal asked
        to stop (read once per iteration by the caller, so that every seed of a stacked run
        decides alike). Returns whether the run stops now (its checkpoint is saved; the caller
        raises :meth:`raise_interrupted`)."""
        cfg = self.cfg
        for k in self._timings:
            self._timings[k] += result.pop(k)
        if self.governor is not None:
            self.governor.update()
        last = self.done
        scheduled = bool(cfg.eval_interval) and self.iteration % cfg.eval_interval == 0
        evaluating = last or scheduled
        logging_now = last or self.iteration % cfg.log_interval == 0 or evaluating
        if logging_now:
            train = self.learner.tracker.read()
            if "episode_return" in train:
                self.last_train = train
            elapsed = time.perf_counter() - self._time_at_start
            sps = (self.env_steps - self._steps_at_start) / max(elapsed, 1e-9)
            metrics: dict[str, float] = {
                "iteration": self.iteration,  # (counts, written as whole numbers)
                "wall_seconds": time.perf_counter() - self._start,
                "steps_per_second": sps,
                "threads": torch.get_num_threads(),
                **self.learner.schedule_metrics(),
                **{f"train/{k}": v for k, v in train.items()},
                **{f"time/{k}": v for k, v in self._timings.items()},
                **{f"loss/{k}": v for k, v in result.items()},
            }
            if evaluating:
                try:
                    evaluated = self.evaluate(stoppable=True)
                except EvaluationStopped:
                    # A signal came during it: stop now, with this iteration's checkpoint and
                    # without its evaluation. The final one too: a scheduler's SIGKILL after
                    # its grace period would otherwise take every update since the last
                    # periodic checkpoint with it (the run is then evaluated by mappo eval).
                    evaluated, stopping = {}, True
                    if last:
                        self.final_eval_stopped = True
                        self.last_eval = {}  # (no older evaluation passes for the final one)
                except Exception as err:
                    if logger is not None:  # the iteration's training row, which no resume redoes
                        with contextlib.suppress(Exception):
                            logger.log(self.env_steps, metrics)
                    self._save_before_raising(err, last)
                    raise
                if last and not scheduled and self.env_steps < cfg.total_env_steps:
                    # (stopped by max_wall_seconds: an evaluation the full run would not make
                    # leaves the count, so that a resumed run's evaluations draw its seeds)
                    self.eval_count -= 1
                metrics.update({f"eval/{k}": v for k, v in evaluated.items()})
            if logger is not None:
                logger.log(self.env_steps, metrics)
            if progress is not None:
                progress.update(
                    self.env_steps, sps, self.last_train.get("episode_return"), final=last
                )
        due = last or stopping or self.iteration % cfg.checkpoint_interval == 0
        if self.run_dir is not None and due:
            # A stop on a signal saves like a periodic checkpoint (without a replay buffer the
            # config leaves out of them): it must finish within a SIGTERM's grace period.
            self.save_checkpoint(time.perf_counter() - self._start, periodic=not last)
        return stopping and (not last or self.final_eval_stopped)

    def _save_before_raising(self, err: Exception, last: bool) -> None:
        """Save a checkpoint of the iteration just trained when its evaluation raised (an
        eval env of the user's own that fails, a broken render), and say so in ``err``'s
        message: the training since the last checkpoint is not lost with the evaluation. The
        checkpoint is one a run stopped by a signal writes; the evaluation is not counted, so
        a resumed run evaluates with the same seed again."""
        if self.run_dir is None:
            return
        try:
            path = self.save_checkpoint(time.perf_counter() - self._start, periodic=True)
        except Exception:  # the evaluation's error is the one to report
            return
        module = imported_module(self.cfg.env.name)
        trust = f" --import {module}" if module else ""
        # (the seeds of a stacked run resume together: every one of their folders)
        # (quoted as a shell reads them: a folder name with spaces stays one word)
        together = shlex.join(str(d) for d in self.stacked_dirs or [self.run_dir])
        then = (
            f"evaluate it with: mappo eval {shlex.quote(str(self.run_dir))}{trust}"
            if last
            else f"continue with: mappo train --resume {together}{trust}"
        )
        saved = (
            f"the evaluation at env step {self.env_steps:,} failed; the training up to it is "
            f"saved in {path}; {then}"
        )
        if len(err.args) == 1 and isinstance(err.args[0], str):
            err.args = (f"{err.args[0]}; {saved}",)
        else:
            warnings.warn(f"{self.error_prefix}{saved}", stacklevel=3)

    def raise_interrupted(self, others: list[Path] | None = None) -> None:
        """Raise :class:`RunInterrupted` for the signal that stopped this run (``others``: the
        directories of runs stopped with it)."""
        assert self.stop_signal is not None and self.run_dir is not None
        raise RunInterrupted(
            self.stop_signal,
            self.run_dir,
            self.env_steps,
            self.last_checkpoint,
            others,
            evaluation_stopped=self.final_eval_stopped,
        )

    def finish(self) -> dict[str, Any]:
        """The summary at the end of training."""
        wall = time.perf_counter() - self._start
        elapsed = max(time.perf_counter() - self._time_at_start, 1e-9)
        return self.summary(wall, (self.env_steps - self._steps_at_start) / elapsed)

    def summary(self, wall: float, sps: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "preset": self.cfg.preset or None,
            "task": self.cfg.env.name,
            "algo": self.cfg.algo_name,
            "seed": self.cfg.seed,
            "env_steps": self.env_steps,
            "iterations": self.iteration,
            "wall_seconds": wall,
            "steps_per_second": sps,
            "train_episode_return": self.last_train.get("episode_return"),
        }
        if self.out_of_time and self.env_steps < self.cfg.total_env_steps:
            out["stopped_at_max_wall_seconds"] = self.cfg.max_wall_seconds
        out.update(self.last_eval)
        return out


def _check_memory(cfg: TrainConfig, device: torch.device, eval_episodes: int | None = None) -> bool:
    """Refuse a run whose estimated memory exceeds what is free (see :mod:`mappo.resources`),
    before its environments allocate anything; with ``eval_episodes``, an evaluation of that
    many episodes at once (``mappo eval``) instead of the run. Returns False where an adapter
    env was not probed (few copies): the trainer checks with the env itself once it is made."""
    adapter = uses_workers(cfg.env.name)
    per_copy = copy_bytes(cfg.env.name)
    envs = cfg.env.num_envs + cfg.eval_episodes if eval_episodes is None else eval_episodes
    if adapter and not per_copy and envs <= _PROBE_ADAPTERS_ABOVE:
        return False
    kwargs = dict(cfg.env.kwargs)
    if adapter:  # the probe's one copy runs in this process, without the worker options
        for key in ("timeout", "envs_per_worker", "start_method", "startup_timeout"):
            kwargs.pop(key, None)
        kwargs["num_workers"] = 0
    with make_env(cfg.env.name, num_envs=1, device=device, seed=cfg.seed, **kwargs) as probe:
        state_bytes = env_state_bytes(probe) + per_copy
        free = available_bytes(device)
        if eval_episodes is not None:
            problem = evaluation_memory_problem(
                eval_episodes, probe.spec, state_bytes, free, device
            )
        else:
            problem = memory_problem(cfg, probe.spec, state_bytes, free, probe.byte_observations)
    if problem is not None:
        raise config_mod.ConfigError(problem)
    return True


def _check_before_networks(
    cfg: TrainConfig, env: BatchedEnv, device: torch.device, probed: bool, seeds: int = 1
) -> None:
    """Before the networks and buffers allocate anything, what ``env``'s spec tells of their
    size: warnings of inputs as large as pictures, and a :class:`ConfigError` where the
    networks' first layers (``seeds`` sets of them) or, for an adapter env the probe was
    spared (``probed`` False), the rollout and buffers would not fit in free memory."""
    _warn_large_observations(cfg, env)
    _warn_unused_by_actions(cfg, env)
    m = cfg.model
    if m.encoder == "cnn" and m.image_scale != 1 and getattr(env, "unit_pictures", False):
        warnings.warn(
            f"the observation space of '{cfg.env.name}' bounds its pictures by 1, and "
            f"model.image_scale={m.image_scale:.6g} divides them by {1 / m.image_scale:.6g} "
            "again; set model.image_scale=1",
            stacklevel=3,
        )
    problem = _network_memory_problem(cfg, env.spec, device, seeds)
    if problem is None and not probed:
        every = dataclasses.replace(
            cfg,
            env=dataclasses.replace(cfg.env, num_envs=cfg.env.num_envs * seeds),
            eval_episodes=cfg.eval_episodes * seeds,
        )
        free = available_bytes(device)
        per_copy = copy_bytes(cfg.env.name)
        problem = memory_problem(every, env.spec, per_copy, free, env.byte_observations)
    if problem is not None:
        raise config_mod.ConfigError(problem)


def _network_memory_problem(
    cfg: TrainConfig, spec: Any, device: torch.device, seeds: int = 1
) -> str | None:
    """A one-line refusal where the networks' first dense layers alone (what they read times
    ``model.hidden_sizes[0]``, with gradients and two Adam moments: 16 bytes a weight) would
    not fit in the free memory: a picture read flat, or convolution maps that the strides
    left large. Else None."""
    m = cfg.model
    width = m.hidden_sizes[0] if m.hidden_sizes else 0
    free = available_bytes(device)
    if free is None or not width:
        return None

    def reads(shape: tuple[int, ...]) -> int:
        maps = _conv_reads(cfg, spec, shape) if m.encoder == "cnn" and len(shape) == 3 else None
        return math.prod(shape) if maps is None else maps

    from mappo.nn.actor_critic import critic_input_shape

    weights = 0
    for name, group in spec.groups.items():
        copies = 1 if m.share_params else group.num_agents
        weights += reads(tuple(group.obs_shape)) * width * copies
        if cfg.family == "ppo":  # the critic: its input's shape
            source = getattr(cfg.algo, "critic_input", "state")
            weights += reads(critic_input_shape(spec, name, source)) * width * copies
    if cfg.algo.name == "maddpg":  # its critic reads the state flat beside every action
        joint = sum(g.num_agents * g.action.total for g in spec.groups.values())
        weights += (math.prod(spec.state_shape) + joint) * width
    elif cfg.algo.name == "facmac":  # each utility reads its agent's observation flat, and the
        for group in spec.groups.values():  # mixer's hypernetworks the state
            copies = 1 if m.share_params else group.num_agents
            weights += (math.prod(group.obs_shape) + group.action.total) * width * copies
        hyper = cfg.algo.hypernet_embed
        if cfg.algo.hypernet_layers == 1:  # the first layer makes every agent's weights
            hyper = cfg.algo.mixing_embed_dim * spec.num_agents
        weights += math.prod(spec.state_shape) * (hyper if cfg.algo.mixer != "vdn" else 0)
    weights *= seeds
    need = 16 * weights
    if need <= _NETWORK_SHARE * free:
        return None
    fix = (
        "larger model.cnn_strides or more convolutions"
        if m.encoder == "cnn"
        else "model.encoder=cnn for pictures, or smaller observations"
    )
    return (
        f"the networks' first dense layers would hold {weights:,} weights ({format_bytes(need)} "
        f"with their gradients and Adam's moments) but {format_bytes(free)} is free on "
        f"{cfg.device}; their inputs are too large: use {fix}, or a smaller "
        "model.hidden_sizes"
    )


_NETWORK_SHARE = 0.5
"""The share of the free memory the networks' first layers may take before a run is refused
(the rollout, the activations and the env need the rest)."""


def check_evaluation_memory(cfg: TrainConfig, episodes: int, device: str | torch.device) -> None:
    """Refuse (:class:`~mappo.config.ConfigError`) an evaluation of ``episodes`` episodes of
    ``cfg``'s env at once whose estimated memory exceeds what is free on ``device``."""
    _check_memory(cfg, torch.device(device), eval_episodes=episodes)


def new_run_dir(cfg: TrainConfig) -> Path:
    """``<run_dir>/<preset or task>/<algo>/<time>_seed<k>/``, created (never an existing one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run_dir) / _task_dir(cfg.preset or cfg.env.name) / cfg.algo_name
    path = base / f"{stamp}_seed{cfg.seed}"
    suffix = 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            if not path.is_dir():
                raise config_mod.ConfigError(
                    f"cannot create the run directory '{path}': a file of that name is in the "
                    "way; move that file, or set run_dir= to another folder"
                ) from None
            # another run of this task and seed started in the same second: the next name
            path = base / f"{stamp}_seed{cfg.seed}_{suffix}"
            suffix += 1
        except OSError as err:
            raise config_mod.ConfigError(
                f"cannot create the run directory '{path}': {err.strerror}; set run_dir= to a "
                "folder you can write"
            ) from None


def train(
    cfg: TrainConfig | str | os.PathLike[str],
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    run_dir: str | Path | None = None,
) -> Run:
    """Train a policy: ``mappo.train("mpe/simple_spread", {"total_env_steps": 100_000})``.

    ``cfg`` is a :class:`TrainConfig`, a preset name or a YAML path; ``overrides`` are
    ``KEY=VALUE`` strings or a dict of keys to values. Returns the :class:`Run`. An ``OSError``
    raised mid-run (a full disk) carries ``mappo_run``: the run directories and the newest
    checkpoint (``None`` before the first), from which :func:`resume` continues.
    """
    with library_defaults():  # (the caller's torch settings come back after)
        cfg = _load(cfg, overrides)
        if cfg.num_seeds > 1:
            raise config_mod.ConfigError(
                f"num_seeds={cfg.num_seeds} trains several runs; call mappo.train_seeds (which "
                "returns one Run per seed), or set num_seeds=1"
            )
        if run_dir is not None:
            _check_unused(Path(run_dir))
        trainer = Trainer(cfg)
        _warn_new_run(cfg)  # (once the env is made: a config refused there has no use for it)
        _trust_own_module(cfg)
        _warn_long_evaluations(cfg, trainer.env.spec.episode_limit)
        _warn_continuous_options(cfg, trainer.env)
        try:
            path = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
            trainer.caller_folder = run_dir is not None and path.is_dir()
            path.mkdir(parents=True, exist_ok=True)
        except BaseException:
            trainer.close()
            raise
        trainer.run_dir = path
        return _run(
            [trainer],
            lambda: [trainer.learn()],
            [None],
        )[0]


def _warn_long_evaluations(cfg: TrainConfig, episode_limit: int) -> None:
    """Warn where the run's evaluations may step more than it trains, by at least 50,000 env
    steps: a short run with a preset's ``eval_episodes`` on an env of long episodes (100
    episodes of a 900-step game are 90,000 steps, minutes of a Python env)."""
    evals = 1  # the final one, which a periodic one at the last update is
    if cfg.family == "ppo" and cfg.eval_interval:
        n, every = cfg.num_updates, cfg.eval_interval
        evals = n // every + (1 if n % every else 0)
    most = evals * cfg.eval_episodes * episode_limit
    if most >= _LONG_EVALUATIONS and most > cfg.total_env_steps:
        warnings.warn(
            f"the run's {evals} evaluation(s) of eval_episodes={cfg.eval_episodes} episodes of "
            f"up to {episode_limit} steps may step {most:,} env steps, more than the "
            f"{cfg.total_env_steps:,} it trains; lower eval_episodes (or raise eval_interval)",
            stacklevel=3,
        )


_LONG_EVALUATIONS = 50_000


def _trust_own_module(cfg: TrainConfig) -> None:
    """A module the caller named to train a fresh run on (``pettingzoo:my_envs``) counts as
    trusted in this process, as ``--import my_envs`` would: the policy just trained evaluates
    (``Run.load_policy().evaluate()``) without being told again. Saved runs stay refused any
    module the process was not given."""
    module = imported_module(cfg.env.name)
    if module is not None:
        trust_module(module)


def _warn_new_run(cfg: TrainConfig) -> None:
    """Warnings for a fresh run (not a resume) whose settings will surprise: a budget below one
    iteration, an env class that no other process can import."""
    per_iteration = cfg.env.num_envs * cfg.rollout_length
    if cfg.family == "ppo" and cfg.total_env_steps < per_iteration:
        warnings.warn(
            f"total_env_steps={cfg.total_env_steps:,} is less than one iteration "
            f"(env.num_envs x rollout_length = {per_iteration:,} env steps), which the run "
            "trains in full; lower env.num_envs for a shorter run",
            stacklevel=3,
        )
    # A value method's own preset: named after the env (smac/3m_qmix) or after the preset
    # (lbf/8x8-2p-2f-coop_qmix, whose env is named by its gymnasium id)
    presets = config_mod.list_presets()
    candidates = [f"{name}_{cfg.algo.name}" for name in (cfg.env.name, cfg.preset) if name]
    own = next((p for p in candidates if p in presets), None)
    value_family = cfg.algo.name != "mappo"  # (mpe/simple_spread_mappo is a MAPPO variant)
    if (
        value_family
        and cfg.preset
        and own is not None
        and config_mod.load(cfg.preset).algo.name != cfg.algo.name  # (not smac/3m_qmix_fast)
    ):
        # A MAPPO preset's env and network settings (64 envs, no GRU) are not the ones the
        # algorithm's own preset takes from PyMARL (one env, a GRU, agent ids).
        warnings.warn(
            f"algo.name={cfg.algo.name} over {cfg.preset} keeps that preset's env and model "
            f"settings; {own} holds {cfg.algo.name}'s own for this task",
            stacklevel=3,
        )
    if imported_module(cfg.env.name) == "__main__":
        scheme = cfg.env.name.partition(":")[0]
        named = "<module>:<class>" if scheme == "python" else "<module>:<callable>"
        warnings.warn(
            f"env.name={cfg.env.name} is a class of the running script, which no other "
            "process can import: this run opens only from a script that defines it (move "
            f"the class into a module, {scheme}:{named}, to evaluate or resume it "
            "with the mappo command)",
            stacklevel=3,
        )


_CONTINUOUS_OPTIONS = ("action_bounds", "log_std_init", "state_dependent_std")


def _warn_continuous_options(cfg: TrainConfig, env: BatchedEnv) -> None:
    """Warn where ``cfg`` sets the Gaussian policy's options for an env that has no group of
    continuous actions (a continuous preset over a discrete env): they do nothing there."""
    if any(g.action.continuous for g in env.spec.groups.values()):
        return
    default = config_mod.ModelConfig()
    set_here = [
        f"model.{k}={getattr(cfg.model, k)}"
        for k in _CONTINUOUS_OPTIONS
        if getattr(cfg.model, k) != getattr(default, k)
    ]
    if set_here:
        warnings.warn(
            f"{', '.join(set_here)}: options of continuous actions, but every group of "
            f"'{cfg.env.name}' acts in discrete actions, so they change nothing",
            stacklevel=3,
        )


# Settings that only act on one kind of action: (section, key, kind it acts on).
_ACTION_KIND_KEYS = {
    "ppo": [
        ("model", "action_bounds", "continuous"),
        ("model", "log_std_init", "continuous"),
        ("model", "state_dependent_std", "continuous"),
    ],
    "maddpg": [
        ("algo", "action_noise", "continuous"),
        ("algo", "actor_reg", "continuous"),
        ("algo", "gumbel_temperature", "discrete"),
        ("algo", "epsilon_start", "discrete"),
        ("algo", "epsilon_finish", "discrete"),
        ("algo", "epsilon_anneal_steps", "discrete"),
        ("algo", "epsilon_schedule", "discrete"),
    ],
}


def _warn_unused_by_actions(cfg: TrainConfig, env: BatchedEnv) -> None:
    """Warn where a setting changed from its default acts on a kind of action (continuous or
    discrete) that no group of ``env`` has: the run trains as if it were not set (a sweep
    over ``algo.action_noise`` on a discrete env would train one run under several names)."""
    kinds = {"continuous" if g.action.continuous else "discrete" for g in env.spec.groups.values()}
    for section, key, kind in _ACTION_KIND_KEYS.get(cfg.family, []):
        part = getattr(cfg, section)
        default = getattr(type(part)(), key)
        if kind not in kinds and getattr(part, key) != default:
            warnings.warn(
                f"{section}.{key}={getattr(part, key)!r} has no effect: it acts on {kind} "
                f"actions, and every group of '{cfg.env.name}' acts in "
                f"{'a box' if kind == 'discrete' else 'discrete actions'}",
                stacklevel=3,
            )


_LARGE_OBSERVATION = 10_000
"""Values per agent's observation above which a run is told that the MLP reads them flat (the
largest of the built-in tasks has about 1,200: SMAC's 27m_vs_30m)."""


def _warn_large_observations(cfg: TrainConfig, env: BatchedEnv) -> None:
    """Warn where a network's first dense layer reads as many values as an image has (a
    PettingZoo butterfly game's 403,200 pixel values): an observation or a centralised input
    (MAPPO's critic on the global state, QMIX's hypernetworks, COMA's critic) read flat, or
    convolution maps that the strides left that large (``model.encoder=cnn``). Such a layer is
    slow and large."""
    m = cfg.model
    first = m.hidden_sizes[0] if m.hidden_sizes else 0
    where = f"'{cfg.env.name}'"
    spec = env.spec
    for name, group in spec.groups.items():
        what = f"group '{name}' of {where} observes"
        _warn_large_input(cfg, spec, what, tuple(group.obs_shape), first, "", True, " per agent")
    state = tuple(env.spec.state_shape)
    algo = cfg.algo.name
    if cfg.family == "ppo" and getattr(cfg.algo, "critic_input", "") == "state":
        fix = "algo.critic_input=local (each agent's critic on its own observation)"
        _warn_large_input(cfg, spec, f"the critic of {where} reads", state, first, fix, True)
    elif algo in ("qmix", "coma"):
        width = getattr(cfg.algo, "hypernet_embed", None) or getattr(cfg.algo, "critic_hidden", 0)
        reader = "QMIX's hypernetworks" if algo == "qmix" else "COMA's critic"
        fix = "algo.name=vdn mixes without the state" if algo == "qmix" else "algo.name=mappo"
        _warn_large_input(cfg, spec, f"{reader} on {where} read", state, width, fix, False)
    elif algo == "maddpg":  # its critic reads the state flat, whatever the actors' encoder
        fix = "algo.name=mappo with algo.critic_input=local"
        _warn_large_input(cfg, spec, f"MADDPG's critic on {where} reads", state, first, fix, False)
    elif algo == "facmac":
        if m.encoder == "cnn":  # its utilities read each observation flat, beside the action
            for name, group in spec.groups.items():
                what = f"FACMAC's utilities of group '{name}' of {where} read"
                shape = tuple(group.obs_shape)
                _warn_large_input(cfg, spec, what, shape, first, "", False, " per agent")
        if cfg.algo.mixer != "vdn":  # the mixer's hypernetworks
            fix = "algo.mixer=vdn mixes without the state"
            width = cfg.algo.hypernet_embed
            if cfg.algo.hypernet_layers == 1:  # (the first layer makes every agent's weights)
                width = cfg.algo.mixing_embed_dim * spec.num_agents
            what = f"FACMAC's mixer on {where} reads"
            _warn_large_input(cfg, spec, what, state, width, fix, False)


def _conv_reads(cfg: TrainConfig, spec: Any, shape: tuple[int, ...]) -> int | None:
    """Values the convolutions of ``model.encoder=cnn`` leave of a picture of ``shape`` for the
    first dense layer, read in the layout the networks take (:func:`picture_layout`); None
    where the layout cannot be told (building the networks then says so in one line)."""
    from mappo.nn.actor_critic import picture_layout
    from mappo.nn.layers import conv_maps, image_layout

    m = cfg.model
    try:
        ch, h, w, _ = image_layout(shape, picture_layout(shape, spec, m), "", warn=False)
    except config_mod.ConfigError:
        return None
    layers = list(zip(m.cnn_channels, m.cnn_kernels, m.cnn_strides, strict=True))
    return conv_maps((ch, h, w), layers)


def _warn_large_input(
    cfg: TrainConfig,
    spec: Any,
    what: str,
    shape: tuple[int, ...],
    width: int,
    fix: str,
    convolved: bool,
    unit: str = "",
) -> None:
    """One warning of :func:`_warn_large_observations`: ``what`` reads an input of ``shape``
    into a dense layer of ``width`` units, through the convolutions where ``convolved`` and
    ``model.encoder=cnn`` and the input is a picture; ``fix``: what else shrinks it."""
    m = cfg.model
    size, image = math.prod(shape), len(shape) == 3
    if m.encoder == "cnn" and image and convolved:
        # (convolutions with stride 1 can make a small picture's maps larger than the picture)
        maps = _conv_reads(cfg, spec, shape)
        if maps is not None and maps > _LARGE_OBSERVATION:
            nature = ([32, 64, 64], [8, 4, 3], [4, 2, 1])
            example = (
                ", e.g. model.cnn_channels=[32,64,64] model.cnn_kernels=[8,4,3] "
                "model.cnn_strides=[4,2,1]"
                if (m.cnn_channels, m.cnn_kernels, m.cnn_strides) != nature
                else ""
            )
            warnings.warn(
                f"{what} {shape} images whose convolutions (model.cnn_channels="
                f"{m.cnn_channels}, cnn_kernels={m.cnn_kernels}, cnn_strides={m.cnn_strides}) "
                f"leave {maps:,} values for the first dense layer ({maps * width:,} weights); "
                f"larger strides or more convolutions shrink them{example}, or pictures "
                "downscaled in the env",
                stacklevel=4,
            )
        return
    if size <= _LARGE_OBSERVATION:
        return
    fixes = ["model.encoder=cnn (convolutions over images)"] if image and convolved else []
    fixes += [fix] if fix else []
    fixes.append("cropping or downscaling them in the env")
    warnings.warn(
        f"{what} {size:,} values{unit} (shape {shape}), flattened into a dense layer that "
        f"alone holds {size * width:,} weights; for a usable speed try {', or '.join(fixes)}",
        stacklevel=4,
    )


def _check_unused(path: Path) -> None:
    """Refuse a run folder given by the caller that already holds a run: a second run written
    into it would replace its config and metrics and leave the first one's later checkpoints
    beside its own, which a resume or an evaluation would then take."""
    if (
        (path / "config.yaml").is_file()
        or (path / "metrics.csv").is_file()
        or any((path / "checkpoints").glob("iter_*.pt"))
    ):
        raise config_mod.ConfigError(
            f"'{path}' already holds a run; continue it with mappo.resume('{path}') (mappo "
            "train --resume), or give the new run a folder of its own"
        )


def _load(
    cfg: TrainConfig | str | os.PathLike[str],
    overrides: Sequence[str] | Mapping[str, Any] | None,
) -> TrainConfig:
    """A preset name, YAML path or config with ``overrides`` applied, checked."""
    if not isinstance(cfg, str | os.PathLike | TrainConfig):
        raise TypeError(
            f"give a preset name, a YAML path or a TrainConfig, got {type(cfg).__name__}"
        )
    values = config_mod.override_values(overrides)
    if isinstance(cfg, os.PathLike):
        cfg = os.fspath(cfg)
    if isinstance(cfg, str):
        return config_mod.load(cfg, values)
    # A copy of the caller's config, each field checked against its own range and type and
    # converted as loading converts it (a config edited in code has met none of those checks:
    # total_env_steps=-5 trained 0 steps, algo.epochs=5.0 failed inside the first update). The
    # caller's object stays as it was, so that a notebook's loop of train(base, overrides)
    # starts from the same config each time.
    copy = config_mod.apply(config_mod.TrainConfig(), config_mod.to_dict(cfg))
    return config_mod.apply(copy, values) if values else copy


def train_seeds(
    cfg: TrainConfig | str | os.PathLike[str],
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> list[Run]:
    """Train seeds ``seed .. seed + num_seeds - 1`` of one configuration at once, in one process
    (:mod:`mappo.learners.seeds`); returns one :class:`Run` per seed, each with its own run
    directory (a single run's, resumable alone or together with :func:`resume_seeds`)."""
    with library_defaults():  # (the caller's torch settings come back after)
        cfg = _load(cfg, overrides)
        n = cfg.num_seeds
        if cfg.seed + n - 1 > 2**32 - 1:
            raise config_mod.ConfigError(
                f"seeds {cfg.seed} .. {cfg.seed + n - 1} exceed 2**32 - 1; lower seed or num_seeds"
            )
        cfgs = [dataclasses.replace(cfg, seed=cfg.seed + k, num_seeds=1) for k in range(n)]
        _warn_new_run(cfg)
        runs = _run_stacked(cfgs, checkpoints=None)
        _trust_own_module(cfg)
        return runs


def train_stacked(cfgs: list[TrainConfig], run_dirs: list[str | Path]) -> list[Run]:
    """Train runs that differ only in their seed (any seeds, e.g. a sweep's ``[1, 5, 9]``)
    together in one process, as :func:`train_seeds` does, seed ``cfgs[k].seed`` into
    ``run_dirs[k]``; returns one :class:`Run` per config."""
    with library_defaults():  # (the caller's torch settings come back after)
        if not cfgs or len(cfgs) != len(run_dirs):
            raise config_mod.ConfigError("give one run directory per config (and at least one)")
        paths = [Path(d) for d in run_dirs]
        if len({p.resolve() for p in paths}) < len(paths):
            raise config_mod.ConfigError("a run directory is given twice; give each seed its own")
        _check_stackable(cfgs, [str(p) for p in paths])
        _warn_new_run(cfgs[0])
        for p in paths:
            _check_unused(p)
        existed = [p.is_dir() for p in paths]
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
        runs = _run_stacked(
            [dataclasses.replace(c, num_seeds=1) for c in cfgs],
            checkpoints=None,
            run_dirs=paths,
            caller_folders=existed,
        )
        _trust_own_module(cfgs[0])
        return runs


def _check_stackable(cfgs: list[TrainConfig], names: list[str]) -> None:
    """One-line errors unless ``cfgs`` (named ``names`` in them) are seeds of one MAPPO-family
    configuration that may train together."""
    first = _comparable(cfgs[0])
    for name, cfg in zip(names[1:], cfgs[1:], strict=True):
        other = _comparable(cfg)
        diff = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        # the algorithm first: its fields differ because it does (mappo's vs maddpg's keys)
        diff.sort(key=lambda k: k != "algo.name")
        if diff:
            raise config_mod.ConfigError(
                f"run '{name}' differs from '{names[0]}' in config field '{diff[0]}'; only "
                "seeds of one configuration train or resume together (run the others separately)"
            )
    if len({c.seed for c in cfgs}) < len(cfgs):
        raise config_mod.ConfigError("two of the runs have the same seed; give distinct seeds")
    if cfgs[0].family != "ppo":
        raise config_mod.ConfigError(
            f"seeds train together for algo.name=mappo only, not {cfgs[0].algo.name!r}; "
            "train each run separately"
        )


def _run_stacked(
    cfgs: list[TrainConfig],
    checkpoints: list[tuple[Path, Path, dict[str, Any]]] | None,
    run_dirs: list[Path] | None = None,
    caller_folders: list[bool] | None = None,
) -> list[Run]:
    """Build the stacked learner of ``cfgs`` (restored from ``checkpoints``, ``(run dir, newest
    checkpoint, its contents)`` per seed, when resuming) and train it to the end; a fresh
    start writes into ``run_dirs`` (default: a new directory per seed), of which those marked
    in ``caller_folders`` existed before (:attr:`Trainer.caller_folder`)."""
    from mappo.learners.seeds import SeedSlot, StackedPPOLearner, make_seed_envs, release

    cfg = cfgs[0]
    device = config_mod.check_device(cfg.device)
    n = len(cfgs)
    probed = _check_memory(
        dataclasses.replace(
            cfg,
            env=dataclasses.replace(cfg.env, num_envs=cfg.env.num_envs * n),
            eval_episodes=cfg.eval_episodes * n,
        ),
        device,
    )
    blocks = make_seed_envs(cfgs, device)
    trainers: list[Trainer] = []
    try:
        _check_before_networks(cfg, blocks.env_of(0), device, probed, seeds=n)
        stack = StackedPPOLearner(cfgs, blocks)
        for k, c in enumerate(cfgs):
            trainers.append(
                Trainer(c, env=blocks.env_of(k), learner=SeedSlot(stack, k), governor=k == 0)
            )
            trainers[k].error_prefix = f"seed {c.seed}: "
        if checkpoints is None:
            _warn_continuous_options(cfg, trainers[0].env)
            for k, t in enumerate(trainers):
                t.run_dir = run_dirs[k] if run_dirs is not None else new_run_dir(t.cfg)
                t.caller_folder = caller_folders is not None and caller_folders[k]
        else:
            for t, (path, newest, ckpt) in zip(trainers, checkpoints, strict=True):
                t.restore_progress(ckpt)
                t.run_dir, t.last_checkpoint = path, newest
            stack.load_seed_states(
                [ckpt["learner"] for _, _, ckpt in checkpoints], trainers[0].iteration
            )
            for path, newest, _ in checkpoints:
                tidy_for_resume(path, newest)
    except BaseException:
        for t in trainers:
            t.close()
            if checkpoints is None and not t.caller_folder:
                _remove_unstarted(t, None)  # the folders made before a later seed's failed
        blocks.close()
        raise

    def iterate_all() -> list[dict[str, float]]:
        envs = [t.env for t in trainers]
        return explained(envs, lambda: stack.iterate(trainers[0].iteration, trainers[0].env_steps))

    resume_steps = [None] * n if checkpoints is None else [t.env_steps for t in trainers]
    try:
        return _run(trainers, iterate_all, resume_steps, locked=checkpoints is not None)
    finally:
        release(stack.policies)


def resume(run_dir: str | Path, overrides: Sequence[str] | Mapping[str, Any] | None = None) -> Run:
    """Continue a run from its newest usable checkpoint.

    ``overrides`` may change what the saved state does not depend on (``total_env_steps``,
    learning rates, intervals...); they are recorded in the run's ``config.yaml``. Nothing in
    the run directory is written before every check has passed, except the summary of a run
    that had trained its budget but stopped before writing one (refused all the same, as
    every run that has reached its budget is)."""
    with library_defaults():  # (the caller's torch settings come back after)
        path = Path(run_dir)
        # The env's name comes from the run's files: a name that imports a module needs the user's
        # trust in it (mappo.envs.registry.from_saved).
        with hold_lock(_existing(path)), from_saved(str(path)):
            newest, ckpt, cfg = _resumable(path, overrides)
            if cfg.num_seeds > 1:
                raise config_mod.ConfigError(
                    "num_seeds cannot be set when resuming one run; give several run directories "
                    "to resume seeds together"
                )
            trainer = Trainer(cfg, checkpoint=ckpt)
            trainer.run_dir = path
            trainer.last_checkpoint = newest
            tidy_for_resume(path, newest)
            return _run(
                [trainer],
                lambda: [trainer.learn()],
                [trainer.env_steps],
                locked=True,
            )[0]


def resume_seeds(
    run_dirs: list[str | Path], overrides: Sequence[str] | Mapping[str, Any] | None = None
) -> list[Run]:
    """Continue several seeds of one configuration together in one process (as
    :func:`train_seeds` trains them); they must be at the same iteration. ``overrides`` apply to
    every seed, as in :func:`resume`."""
    with library_defaults():  # (the caller's torch settings come back after)
        paths = [Path(d) for d in run_dirs]
        if len({p.resolve() for p in paths}) < len(paths):
            raise config_mod.ConfigError("a run directory is given twice; give each seed's once")
        with contextlib.ExitStack() as locks:
            for p in paths:
                locks.enter_context(hold_lock(_existing(p)))
            locks.enter_context(from_saved(str(paths[0])))  # as in resume()
            found = [_resumable(p, overrides) for p in paths]
            cfgs = [cfg for _, _, cfg in found]
            if any(c.num_seeds > 1 for c in cfgs):  # (as resume() refuses it for one run)
                raise config_mod.ConfigError(
                    "num_seeds cannot be set when resuming; the run directories given are the "
                    "seeds that resume together"
                )
            _check_stackable(cfgs, [str(p) for p in paths])
            iterations = sorted({int(ckpt["progress"]["iteration"]) for _, ckpt, _ in found})
            if len(iterations) > 1:
                raise config_mod.ConfigError(
                    f"the runs' newest checkpoints are at different iterations {iterations}; "
                    "resume them separately, or each to the same iteration first"
                )
            return _run_stacked(
                [dataclasses.replace(c, num_seeds=1) for c in cfgs],
                [(p, newest, ckpt) for p, (newest, ckpt, _) in zip(paths, found, strict=True)],
            )


def _existing(path: Path) -> Path:
    """``path``, or a one-line error if it is not a directory."""
    if path.is_file():  # a checkpoint, as eval takes: a resume continues the run's newest one
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        raise CheckpointError(
            f"'{path}' is a file; resume takes the run directory ('{run}'), and continues "
            "from its newest usable checkpoint"
        )
    if not path.is_dir():
        raise CheckpointError(f"run directory '{path}' does not exist")
    return path


def _resumable(
    path: Path, overrides: Sequence[str] | Mapping[str, Any] | None
) -> tuple[Path, dict[str, Any], TrainConfig]:
    """A run's newest checkpoint, its contents and the config to continue with (checked)."""
    newest, ckpt = load_latest(path)
    differs = config_file_difference(path, ckpt["config"])
    if differs is not None and differs[0]:
        raise config_mod.ConfigError(
            f"'{newest}' is not a checkpoint of the run that '{path / 'config.yaml'}' "
            f"describes ({difference_text(*differs[1][0])}): a checkpoint "
            "copied from another run, or config.yaml edited by hand. Move that checkpoint out "
            "of checkpoints/ (or restore config.yaml) and resume again; changes to a run go "
            "on the command line, `mappo train --resume RUN_DIR KEY=VALUE`"
        )
    saved = config_mod.from_dict(ckpt["config"])
    cfg = config_mod.from_dict(ckpt["config"])
    values = config_mod.override_values(overrides)
    if values:
        # (saved: what the newer checks cover cannot change on resume)
        cfg = config_mod.apply(cfg, values, saved=True)
    _check_resumable(saved, cfg)
    config_mod.check_logging(cfg)
    if differs is not None:
        given = config_mod._flatten(config_mod.to_dict(cfg))
        # (what the command line sets now, config.yaml will say again)
        left = [(k, w, h) for k, w, h in differs[1] if w != given.get(k)]
        if left:
            named = ", ".join(difference_text(*d) for d in left)
            warnings.warn(
                f"'{path / 'config.yaml'}' differs from the newest checkpoint ({named}); a "
                "resume continues with the checkpoint's config and the KEY=VALUE overrides "
                "of its command line, and rewrites config.yaml",
                stacklevel=3,
            )
    done = int(ckpt["progress"]["env_steps"])
    decays = getattr(cfg.algo, "lr_decay", False) and getattr(saved.algo, "lr_decay", False)
    if decays and cfg.total_env_steps != saved.total_env_steps and done < cfg.total_env_steps:
        warnings.warn(
            f"algo.lr_decay decays the learning rates to zero over total_env_steps; with "
            f"{cfg.total_env_steps:,} in place of {saved.total_env_steps:,} they continue from "
            f"{1 - done / cfg.total_env_steps:.0%} of their start where the run had them at "
            f"{max(0.0, 1 - done / saved.total_env_steps):.0%}, a schedule no fresh run follows",
            stacklevel=3,
        )
    if done >= cfg.total_env_steps:
        repaired = ""
        from mappo.experiments.runs import summary_from_checkpoint, summary_steps

        if summary_steps(path) < done and done >= saved.total_env_steps:
            # Killed between its final checkpoint and its summary: finished all the same.
            summary_from_checkpoint(path, newest, done)
            repaired = (
                f"; it stopped before writing its summary, which is now written from '{newest}' "
                "(reports count the run as complete)"
            )
        raise config_mod.ConfigError(
            f"run '{path}' already reached total_env_steps={cfg.total_env_steps:,} "
            f"({done:,} steps){repaired}; resume with a larger total_env_steps=N to train further"
        )
    return newest, ckpt, cfg


def _comparable(cfg: TrainConfig) -> dict[str, Any]:
    """The config fields that seeds trained together must share: all but the seed and each
    run's own bookkeeping (its directory, logging and evaluation intervals); the budget, the
    device and the compiled path are shared by the one loop."""
    from mappo.experiments.runs import BOOKKEEPING_KEYS

    own = set(BOOKKEEPING_KEYS) - {"total_env_steps", "max_wall_seconds", "device", "compile"}
    flat = config_mod._flatten(config_mod.to_dict(cfg))
    return {k: v for k, v in flat.items() if k not in own}


# What a checkpoint's state depends on: these keys cannot change when a run is resumed.
_FIXED_ON_RESUME = ("seed", "env.name", "env.num_envs", "env.kwargs", "algo.name", "model.")
_FIXED_ALGO_KEYS = (
    "algo.buffer_size",
    "algo.last_action",
    "algo.critic_input",
    "algo.death_masked_critic",  # the critic's input width
    "algo.value_norm",  # the critic's normaliser (PopArt's also rescales its output layer)
    "algo.critic_hidden",
    "algo.mixing_embed_dim",
    "algo.hypernet_layers",
    "algo.hypernet_embed",
    "algo.optimizer",  # the checkpoint's optimiser state is that optimiser's
)


# Env keyword arguments that only spread the envs over processes (the adapters' options): a run
# moved to a machine with other cores may change them.
_WORK_SPLIT_KWARGS = (
    "num_workers",
    "envs_per_worker",
    "start_method",
    "timeout",
    "startup_timeout",
)


def _fixed_on_resume(key: str) -> bool:
    """Whether the config key ``key`` (dotted) is one a checkpoint's state depends on."""
    return key.startswith(_FIXED_ON_RESUME) or key in _FIXED_ALGO_KEYS


def _without_work_split(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config without the adapters' worker options in its ``env.kwargs``."""
    kwargs = flat.get("env.kwargs") or {}
    if not isinstance(kwargs, dict):
        return flat
    return {**flat, "env.kwargs": {k: v for k, v in kwargs.items() if k not in _WORK_SPLIT_KWARGS}}


def difference_text(key: str, written: Any, held: Any) -> str:
    """One difference of :func:`config_file_difference` in words."""
    return f"{key}: {written!r} there, {held!r} in the checkpoint"


def config_file_difference(
    run_dir: Path, saved: dict[str, Any]
) -> tuple[bool, list[tuple[str, Any, Any]]] | None:
    """How a run's ``config.yaml`` differs from the config ``saved`` in its newest checkpoint:
    ``(fixed, [(key, in config.yaml, in the checkpoint), ...])``, where ``fixed`` says that the
    keys listed are ones fixed on resume (the checkpoint is then of another run, or the file
    was edited by hand) and otherwise lists every key that differs; ``None`` where they agree,
    or where the file is missing or no config (the checkpoint's config is the run's then: a
    resume rewrites the file). Keys that only one of them has are not compared. Neither file
    is changed."""
    import yaml

    try:
        written = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        held = yaml.safe_load(yaml.safe_dump(saved, sort_keys=False))  # (as the file holds it)
        a = _without_work_split(config_mod._flatten(written))
        b = _without_work_split(config_mod._flatten(held))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, ValueError):
        return None  # (ConfigError is a ValueError; a file that is no mapping has no .items)
    # Keys in one of them only are a difference of versions (a field added since), not of runs.
    keys = [k for k in b if k in a and k not in ("run_dir", "name")]
    differ = [(k, a[k], b[k]) for k in keys if a[k] != b[k]]
    fixed = [d for d in differ if _fixed_on_resume(d[0])]
    if fixed:
        return True, fixed
    return (False, differ) if differ else None


def _check_resumable(saved: TrainConfig, cfg: TrainConfig) -> None:
    """Refuse overrides that the checkpoint's state cannot follow (shapes, the env, the seed)."""
    old = config_mod._flatten(config_mod.to_dict(saved))
    new = config_mod._flatten(config_mod.to_dict(cfg))
    for key in ("run_dir", "name"):
        if old.get(key) != new.get(key):
            raise config_mod.ConfigError(
                f"config field '{key}' places a new run and cannot change when resuming "
                f"({old.get(key)!r} -> {new.get(key)!r}): a resumed run continues in its own "
                "folder (move or copy the folder to have it elsewhere)"
            )
    old, new = _without_work_split(old), _without_work_split(new)
    for key in new:
        if _fixed_on_resume(key) and old.get(key) != new[key]:
            raise config_mod.ConfigError(
                f"config field '{key}' cannot change when resuming ({old.get(key)!r} -> "
                f"{new[key]!r}); the keys fixed on resume are seed, env.*, model.*, algo.name "
                "and the algorithm's network and buffer sizes, critic input, value normaliser "
                "and optimiser. Start a new run instead"
            )


def _bf16_device(device: torch.device) -> str:
    """The kind of device that emulates bf16, for the warning (see bf16_is_emulated)."""
    if device.type == "cuda":
        return "a GPU older than Ampere"
    return "a CPU without AMX or AVX512-BF16"


@contextlib.contextmanager
def hold_lock(folder: Path, what: str = "run") -> Iterator[None]:
    """Hold ``folder/.lock`` while a process works in it: a second process (a resume of a run
    still training, a second sweep on the same directory) gets a one-line refusal. The OS
    releases the lock when the holder exits, killed or not, so a stale lock file never blocks."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; runs are not guarded there
        yield
        return
    lock_path = folder / ".lock"
    with open(lock_path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            raise CheckpointError(
                f"{what} '{folder}' is in use by another mappo process (pid {pid}); wait for it "
                "to finish or stop it, then try again"
            ) from None
        except OSError as err:  # a filesystem without locks (some NFS, Lustre): run unguarded
            warnings.warn(
                f"{what} '{folder}' cannot be locked ({err.strerror}); do not run it twice at once",
                stacklevel=3,
            )
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _stop_on_signals(trainers: list[Trainer]) -> Iterator[None]:
    """SIGINT / SIGTERM ask the trainer to finish its iteration, checkpoint and stop
    (:class:`RunInterrupted`); a second signal stops at once. Only the main thread may install
    handlers; elsewhere the signals keep their behaviour."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        again = trainers[0].stop_signal is not None
        for trainer in trainers:
            trainer.stop_signal = signum
        if again:
            raise KeyboardInterrupt
        # An iteration (or a cold compile inside it) may run for a minute: say that the signal
        # arrived, so that a second one is a choice. (os.write: no buffered stream is touched
        # inside a handler, which may run in the middle of another write.)
        with contextlib.suppress(OSError):
            os.write(
                2,
                b"\nmappo: stopping after this iteration, with a checkpoint (a second "
                b"signal stops at once)\n",
            )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _with_the_others(
    diverged: dict[int, TrainingDiverged], trainers: list[Trainer]
) -> TrainingDiverged:
    """The first diverged stacked seed's error, naming the other seeds that diverged in the
    same iteration and how the healthy ones, stopped at their newest checkpoints, continue."""
    first = diverged[min(diverged)]
    text = str(first)
    if len(diverged) > 1:
        seeds = ", ".join(str(trainers[k].cfg.seed) for k in sorted(diverged)[1:])
        text += f" (seeds {seeds} diverged in this update too)"
    healthy = [
        t for k, t in enumerate(trainers) if k not in diverged and t.last_checkpoint is not None
    ]
    if healthy:
        dirs = shlex.join(str(t.run_dir) for t in healthy)
        module = imported_module(trainers[0].cfg.env.name)
        trust = f" --import {module}" if module else ""
        text += (
            f"; the other seeds stopped with it at their newest checkpoints: continue them "
            f"with `mappo train --resume {dirs}{trust}`"
        )
    return TrainingDiverged(text)


def _save_unsaved(trainers: list[Trainer]) -> None:
    """Save a checkpoint of each trainer whose newest one is not of its current iteration, if
    any of them saved this iteration (the seeds of a stacked run stopped by an error)."""
    if not any(t.saved_iteration == t.iteration for t in trainers):
        return
    for t in trainers:
        if t.run_dir is not None and t.saved_iteration != t.iteration:
            with contextlib.suppress(Exception):  # the error that stopped them comes first
                t.save_checkpoint(time.perf_counter() - t._start, periodic=True)


def _remove_unstarted(trainer: Trainer, logger: MetricsLogger | None) -> None:
    """Remove what a fresh run wrote before it failed, where that is nothing but its setup (no
    checkpoint, no metrics row, no Weights & Biases run): config.yaml, this process's
    TensorBoard file, the lock, then the folder and its parents below ``run_dir`` that are left
    empty. Anything else in the folder (a run_dir given by the caller that held files) stays,
    and so does a caller's folder that existed before the run, empty or not."""
    path = trainer.run_dir
    if path is None or trainer.last_checkpoint is not None:
        return
    if logger is not None and (logger.rows or logger.wandb_started):
        return  # (a W&B run was started: its record stays with the folder)
    with contextlib.suppress(OSError):  # best effort: the run's error is what gets reported
        for name in ("config.yaml", "metrics.csv", ".lock"):
            (path / name).unlink(missing_ok=True)
        board = path / "tensorboard"
        for event in board.glob(f"events.out.tfevents.*.{os.getpid()}.*"):
            event.unlink()
        if board.is_dir() and not any(board.iterdir()):
            board.rmdir()
        here, root = path.resolve(), Path(trainer.cfg.run_dir).resolve()
        chain = [here, *(p for p in here.parents if root in p.parents)]  # (below root only)
        if trainer.caller_folder:
            chain = []
        for folder in chain:
            if any(folder.iterdir()):
                break
            folder.rmdir()


def _wandb_group(cfg: TrainConfig) -> str:
    """The W&B group of a run: its preset (or env) and algorithm, and a short hash of its
    settings apart from the seed and bookkeeping, so that the seeds of one configuration share
    a group and a sweep's other settings do not (as ``mappo report`` groups runs)."""
    import hashlib

    from mappo.experiments.runs import full_config, setting_items

    items = setting_items(full_config(config_mod.to_dict(cfg)))
    digest = hashlib.sha1(repr(items).encode()).hexdigest()[:6]
    return f"{cfg.preset or cfg.env.name} {cfg.algo_name} {digest}"


def _drop_stale_summary(run_dir: Path, step: int) -> None:
    """Remove ``summary.json`` where it describes steps past ``step``, the checkpoint a resume
    starts from (an older one than the newest): its numbers are of a future the resume
    abandons, which metrics.csv and TensorBoard no longer hold. The finish writes it again."""
    path = run_dir / "summary.json"
    try:
        done = json.loads(path.read_text(encoding="utf-8")).get("env_steps")
    except (OSError, ValueError, AttributeError, RecursionError):  # (nested past the parser)
        return  # none, or not ours to judge
    if isinstance(done, int) and done > step:
        path.unlink(missing_ok=True)


def _run(
    trainers: list[Trainer],
    iterate_all: Callable[[], list[dict[str, float]]],
    resume_steps: list[int | None],
    locked: bool = False,
) -> list[Run]:
    """Train ``trainers`` (one run, or the seeds of a stacked run) to the end: ``iterate_all``
    runs one iteration of all of them and returns each one's result."""
    cfg = trainers[0].cfg
    paths = [t.run_dir for t in trainers]
    assert all(p is not None for p in paths)
    if len(trainers) > 1:
        for t in trainers:
            t.stacked_dirs = [p for p in paths if p is not None]
    loggers: list[MetricsLogger] = []

    def tidy_unstarted() -> None:
        # A fresh run stopped (an env failing in its first steps, or a second Ctrl-C in its
        # first iteration) before anything was trained: its folders would hold a config and
        # nothing to resume, evaluate or report.
        if all(step is None for step in resume_steps):
            for k, t in enumerate(trainers):
                # (a seed whose logger did not start, W&B refusing it, wrote only its setup)
                _remove_unstarted(t, loggers[k] if k < len(loggers) else None)

    try:
        with contextlib.ExitStack() as stack:
            for t, step in zip(trainers, resume_steps, strict=True):
                assert t.run_dir is not None
                if not locked:
                    stack.enter_context(hold_lock(t.run_dir))
                # Read (and check) the metrics of a resumed run before anything is written.
                logger = MetricsLogger(
                    t.run_dir,
                    t.cfg.tensorboard,
                    t.cfg.wandb_project if t.cfg.wandb else None,
                    config_mod.to_dict(t.cfg),
                    resume_step=step,
                    wandb_group=_wandb_group(t.cfg) if t.cfg.wandb else None,
                )
                stack.push(logger.exit)
                loggers.append(logger)
                if step is not None:
                    _drop_stale_summary(t.run_dir, step)
            for t in trainers:
                assert t.run_dir is not None
                config_mod.save(t.cfg, t.run_dir / "config.yaml")
            progress = (
                ProgressBar(cfg.total_env_steps, time_limit=cfg.max_wall_seconds)
                if cfg.progress
                else None
            )
            with _stop_on_signals(trainers):
                for t in trainers:
                    t.begin()
                    t.eval_stoppable = len(trainers) == 1
                while not trainers[0].done:
                    results = [t.count(r) for t, r in zip(trainers, iterate_all(), strict=True)]
                    # Every seed is checked before any logs or saves, and a signal is read
                    # once: the seeds' newest checkpoints stay at one iteration.
                    diverged: dict[int, TrainingDiverged] = {}
                    for k, (t, result) in enumerate(zip(trainers, results, strict=True)):
                        try:
                            t.check_finite(result)
                        except TrainingDiverged as err:
                            diverged[k] = err
                    if diverged:
                        raise _with_the_others(diverged, trainers) from diverged[min(diverged)]
                    for t in trainers:
                        t.check_someone_alive()
                        t.check_episodes_end()
                    signalled = trainers[0].stop_signal is not None
                    limit = cfg.max_wall_seconds
                    if limit and time.perf_counter() - trainers[0]._time_at_start >= limit:
                        for t in trainers:  # (one decision for the seeds of a stacked run)
                            t.out_of_time = True
                    stopping = False
                    failed: Exception | None = None
                    for k, (t, result) in enumerate(zip(trainers, results, strict=True)):
                        shown = progress if k == 0 else None
                        try:
                            stopping = t.after_iteration(result, loggers[k], shown, signalled)
                        except Exception as err:
                            # (an evaluation that raised logged and saved its seed's iteration)
                            # the other seeds log and save theirs too: stacked seeds resume at
                            # one iteration, each with its rows
                            failed = failed or err
                    if failed is not None:
                        _save_unsaved(trainers)
                        raise failed
                    if stopping:
                        trainers[0].raise_interrupted([t.run_dir for t in trainers[1:]])  # type: ignore[misc]
                summaries = [t.finish() for t in trainers]
    except KeyboardInterrupt:
        # A second Ctrl-C during an iteration: the checkpoints written so far are intact.
        tidy_unstarted()
        t = trainers[0]
        signum = t.stop_signal or signal.SIGINT
        raise RunInterrupted(
            signum,
            t.run_dir,
            t.env_steps,
            t.last_checkpoint,
            [u.run_dir for u in trainers[1:]],  # type: ignore[arg-type,misc]
            saved_at_stop=False,
        ) from None
    except Exception as err:
        tidy_unstarted()
        if isinstance(err, OSError):
            # A failed write mid-run (a full disk under the logs): the caller can name the
            # run and its newest checkpoint, from which it resumes.
            err.mappo_run = (  # type: ignore[attr-defined]
                [t.run_dir for t in trainers],
                trainers[0].last_checkpoint,
            )
        raise
    finally:
        for t in trainers:
            t.close()
    runs = []
    for t, summary in zip(trainers, summaries, strict=True):
        path = t.run_dir
        assert path is not None
        summary["run_dir"] = str(path)
        tmp = path / "summary.json.tmp"
        # The file holds the folder's absolute path: a relative one would hold only from the
        # folder that the command ran in (which a resume from elsewhere changed).
        tmp.write_text(
            json.dumps({**summary, "run_dir": str(path.absolute())}, indent=2), encoding="utf-8"
        )
        tmp.replace(path / "summary.json")
        runs.append(Run(path, t.cfg, summary, t.policy, stop_signal=t.stop_signal))
    return runs
