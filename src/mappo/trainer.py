"""The training loop: collect -> returns -> update -> log / evaluate / checkpoint.

A run directory ``runs/<task>/<algo>/<time>_seed<k>/`` holds the resolved ``config.yaml``,
``metrics.csv``, TensorBoard events, ``checkpoints/`` (everything needed to resume exactly: model,
optimisers, normalisers, RNG states, env state, counters) and ``summary.json``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mappo import config as config_mod
from mappo.checkpoint import (  # noqa: F401 - re-exported: part of the trainer's interface
    FORMAT,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_rotating,
)
from mappo.config import TrainConfig
from mappo.data import spec_to_dict
from mappo.envs.registry import make as make_env
from mappo.evaluation import evaluate
from mappo.learners import Learner, make_learner
from mappo.logging import MetricsLogger, ProgressBar

_EVAL_SEED_OFFSET = 1_000_003


@dataclass
class Run:
    """The result of :func:`train`: where it was written and what it reached."""

    dir: Path
    config: TrainConfig
    summary: dict[str, Any]
    policy: Any = field(repr=False)
    """The trained networks (an :class:`~mappo.nn.actor_critic.ActorCritic` for mappo, a
    :class:`~mappo.nn.q_agents.QNetworks` for the value family)."""


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
    ) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise config_mod.ConfigError(
                "config field 'device' is 'cuda' but no CUDA device is available; use device=cpu"
            )
        self.env = make_env(
            cfg.env.name, num_envs=cfg.env.num_envs, device=device, seed=cfg.seed, **cfg.env.kwargs
        )
        self.eval_env = make_env(
            cfg.env.name,
            num_envs=cfg.eval_episodes,
            device=device,
            seed=cfg.seed + _EVAL_SEED_OFFSET,
            **cfg.env.kwargs,
        )
        self.device = self.env.device
        self.learner: Learner = make_learner(cfg, self.env)
        self.iteration = 0
        self.env_steps = 0
        self.wall_offset = 0.0
        self.eval_count = 0
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}
        if checkpoint is not None:
            self._restore(checkpoint)
        self.run_dir = run_dir

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
        result = self.learner.iterate(self.iteration, self.env_steps)
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
                "eval_count": self.eval_count,
                "last_eval": self.last_eval,
            },
            "learner": self.learner.state_dict(periodic=periodic),
        }

    def _restore(self, ckpt: dict[str, Any]) -> None:
        progress = ckpt["progress"]
        self.iteration = int(progress["iteration"])
        self.env_steps = int(progress["env_steps"])
        self.wall_offset = float(progress["wall_seconds"])
        self.eval_count = int(progress["eval_count"])
        self.last_eval = dict(progress["last_eval"])
        self.learner.load_state_dict(ckpt["learner"], self.iteration)

    def save_checkpoint(self, wall_seconds: float, periodic: bool = False) -> Path:
        assert self.run_dir is not None
        return save_rotating(
            self.state_dict(wall_seconds, periodic),
            self.run_dir,
            self.iteration,
            self.cfg.keep_checkpoints,
        )

    def close(self) -> None:
        """Release the environments' resources (worker processes of adapted envs)."""
        self.env.close()
        self.eval_env.close()

    # -- the loop -----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        self.policy.eval()
        result = evaluate(
            self.policy, self.eval_env, seed=self.cfg.seed + _EVAL_SEED_OFFSET + self.eval_count
        )
        self.eval_count += 1
        self.last_eval = result
        return result

    def run(
        self, logger: MetricsLogger | None = None, progress: ProgressBar | None = None
    ) -> dict[str, Any]:
        """Train until ``total_env_steps``; returns the summary."""
        cfg = self.cfg
        start = time.perf_counter() - self.wall_offset
        steps_at_start, time_at_start = self.env_steps, time.perf_counter()
        timings = {"rollout_seconds": 0.0, "update_seconds": 0.0}
        while self.env_steps < cfg.total_env_steps:
            result = self.iterate()
            for k in timings:
                timings[k] += result.pop(k)
            last = self.env_steps >= cfg.total_env_steps
            evaluating = last or (cfg.eval_interval and self.iteration % cfg.eval_interval == 0)
            logging_now = last or self.iteration % cfg.log_interval == 0 or evaluating
            if logging_now:
                train = self.learner.tracker.read()
                if "episode_return" in train:
                    self.last_train = train
                elapsed = time.perf_counter() - time_at_start
                sps = (self.env_steps - steps_at_start) / max(elapsed, 1e-9)
                metrics: dict[str, float] = {
                    "iteration": float(self.iteration),
                    "wall_seconds": time.perf_counter() - start,
                    "steps_per_second": sps,
                    **self.learner.schedule_metrics(),
                    **{f"train/{k}": v for k, v in train.items()},
                    **{f"time/{k}": v for k, v in timings.items()},
                    **{f"loss/{k}": v for k, v in result.items()},
                }
                if evaluating:
                    metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
                if logger is not None:
                    logger.log(self.env_steps, metrics)
                if progress is not None:
                    progress.update(
                        self.env_steps, sps, self.last_train.get("episode_return"), final=last
                    )
            if self.run_dir is not None and (last or self.iteration % cfg.checkpoint_interval == 0):
                self.save_checkpoint(time.perf_counter() - start, periodic=not last)
        wall = time.perf_counter() - start
        return self.summary(
            wall, (self.env_steps - steps_at_start) / max(time.perf_counter() - time_at_start, 1e-9)
        )

    def summary(self, wall: float, sps: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task": self.cfg.env.name,
            "algo": self.cfg.algo_name,
            "seed": self.cfg.seed,
            "env_steps": self.env_steps,
            "iterations": self.iteration,
            "wall_seconds": wall,
            "steps_per_second": sps,
            "train_episode_return": self.last_train.get("episode_return"),
        }
        out.update(self.last_eval)
        return out


def new_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run_dir) / _task_dir(cfg.env.name) / cfg.algo_name
    path = base / f"{stamp}_seed{cfg.seed}"
    suffix = 1
    while path.exists():
        path = base / f"{stamp}_seed{cfg.seed}_{suffix}"
        suffix += 1
    path.mkdir(parents=True)
    return path


def train(
    cfg: TrainConfig | str,
    overrides: list[str] | dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
) -> Run:
    """Train a policy: ``mappo.train("mpe/simple_spread", {"total_env_steps": 100_000})``.

    ``cfg`` is a :class:`TrainConfig`, a preset name or a YAML path; ``overrides`` are
    ``KEY=VALUE`` strings or a dict of keys to values. Returns the :class:`Run`.
    """
    if isinstance(cfg, str):
        cfg = config_mod.load(cfg, overrides)
    elif overrides:
        cfg = config_mod.apply(
            cfg, config_mod.parse_overrides(overrides) if isinstance(overrides, list) else overrides
        )
    else:
        config_mod.check(cfg)
    trainer = Trainer(cfg)
    path = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    trainer.run_dir = path
    config_mod.save(cfg, path / "config.yaml")
    return _run(trainer, resume_step=None)


def resume(run_dir: str | Path, overrides: list[str] | dict[str, Any] | None = None) -> Run:
    """Continue a run from its newest checkpoint (``overrides`` may raise ``total_env_steps``)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise CheckpointError(f"run directory '{path}' does not exist")
    ckpt = load_checkpoint(latest_checkpoint(path))
    saved = config_mod.from_dict(ckpt["config"])
    cfg = config_mod.from_dict(ckpt["config"])
    if overrides:
        cfg = config_mod.apply(
            cfg, config_mod.parse_overrides(overrides) if isinstance(overrides, list) else overrides
        )
    _check_resumable(saved, cfg)
    trainer = Trainer(cfg, checkpoint=ckpt)
    trainer.run_dir = path
    config_mod.save(cfg, path / "config.yaml")
    return _run(trainer, resume_step=trainer.env_steps)


# What a checkpoint's state depends on: these keys cannot change when a run is resumed.
_FIXED_ON_RESUME = ("seed", "env.name", "env.num_envs", "env.kwargs", "algo.name", "model.")
_FIXED_ALGO_KEYS = (
    "algo.buffer_size",
    "algo.last_action",
    "algo.critic_input",
    "algo.critic_hidden",
)


def _check_resumable(saved: TrainConfig, cfg: TrainConfig) -> None:
    """Refuse overrides that the checkpoint's state cannot follow (shapes, the env, the seed)."""
    old = config_mod._flatten(config_mod.to_dict(saved))
    new = config_mod._flatten(config_mod.to_dict(cfg))
    for key in new:
        fixed = key.startswith(_FIXED_ON_RESUME) or key in _FIXED_ALGO_KEYS
        if fixed and old.get(key) != new[key]:
            raise config_mod.ConfigError(
                f"config field '{key}' cannot change when resuming ({old.get(key)!r} -> "
                f"{new[key]!r}); the keys fixed on resume are seed, env.*, model.*, algo.name "
                "and the algorithm's network and buffer sizes. Start a new run instead"
            )


def _run(trainer: Trainer, resume_step: int | None) -> Run:
    cfg = trainer.cfg
    assert trainer.run_dir is not None
    logger = MetricsLogger(
        trainer.run_dir,
        cfg.tensorboard,
        cfg.wandb_project if cfg.wandb else None,
        config_mod.to_dict(cfg),
        resume_step=resume_step,
    )
    progress = ProgressBar(cfg.total_env_steps) if cfg.progress else None
    try:
        summary = trainer.run(logger, progress)
    finally:
        logger.close()
        trainer.close()
    summary["run_dir"] = str(trainer.run_dir)
    tmp = trainer.run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(trainer.run_dir / "summary.json")
    return Run(trainer.run_dir, cfg, summary, trainer.policy)
