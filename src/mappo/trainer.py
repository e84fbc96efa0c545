"""The training loop: collect -> returns -> update -> log / evaluate / checkpoint.

A run directory ``runs/<task>/<algo>/<time>_seed<k>/`` holds the resolved ``config.yaml``,
``metrics.csv``, TensorBoard events, ``checkpoints/`` (everything needed to resume exactly: model,
optimisers, normalisers, RNG states, env state, counters) and ``summary.json``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mappo import config as config_mod
from mappo.algos.mappo import Optimizers, make_samples, update
from mappo.config import TrainConfig
from mappo.envs.base import BatchedEnv, EnvStep, spec_to_dict
from mappo.envs.registry import make as make_env
from mappo.logging import MetricsLogger, ProgressBar
from mappo.nn.actor_critic import ActorCritic
from mappo.rollout import Collector, EpisodeTracker, allocate

CHECKPOINT_FORMAT = 1
_EVAL_SEED_OFFSET = 1_000_003


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used; the message says why and what to do."""


@dataclass
class Run:
    """The result of :func:`train`: where it was written and what it reached."""

    dir: Path
    config: TrainConfig
    summary: dict[str, Any]
    policy: ActorCritic = field(repr=False)


# -- helpers ----------------------------------------------------------------------------------


def build_policy(env: BatchedEnv, cfg: TrainConfig) -> ActorCritic:
    """The actor-critic for ``env``, initialised from ``cfg.seed`` without touching torch's
    global RNG state (the caller's random stream is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        policy = ActorCritic(env.spec, cfg.model, cfg.algo)
    return policy.to(env.device)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@torch.no_grad()
def evaluate(
    policy: ActorCritic,
    env: BatchedEnv,
    seed: int,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """One episode in each of ``env.num_envs`` envs with greedy (or sampled) actions.

    Returns the mean and standard deviation of the per-agent episode return and the mean of
    each episode statistic, over the first episode of every env.
    """
    step = env.reset(seed=seed)
    E = env.num_envs
    actor_states, _ = policy.initial_states(E, env.device)
    starts = torch.ones(1, E, dtype=torch.bool, device=env.device)
    returns = torch.zeros(E, device=env.device)
    finished = torch.zeros(E, dtype=torch.bool, device=env.device)
    final_returns = torch.zeros(E, device=env.device)
    stats = {name: torch.zeros(E, device=env.device) for name in env.spec.stat_names}
    for _ in range(env.spec.episode_limit + 1):
        actions = {}
        for name, actor in policy.actors.items():
            mask = step.action_mask.get(name)
            dist, actor_states[name] = actor(
                step.obs[name].unsqueeze(0),
                actor_states[name],
                starts,
                None if mask is None else mask.unsqueeze(0),
            )
            actions[name] = (dist.mode() if deterministic else dist.sample(generator))[0]
        step = env.step(actions)
        reward = torch.cat(list(step.reward.values()), dim=1).mean(1)
        returns += reward * (~finished)
        first = step.done & ~finished
        final_returns = torch.where(first, returns, final_returns)
        for name, value in step.stats.items():
            if name in stats:
                stats[name] = torch.where(first, value.to(stats[name].dtype), stats[name])
        finished |= step.done
        starts = step.done.unsqueeze(0)
        if bool(finished.all()):
            break
    out = {
        "eval_return_mean": float(final_returns.mean()),
        "eval_return_std": float(final_returns.std(unbiased=False)),
        "eval_episodes": float(E),
    }
    out.update({f"eval_{k}": float(v.mean()) for k, v in stats.items()})
    return out


def _atomic_save(obj: Any, path: Path) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file safely (``weights_only=True``: opening it never runs code)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(
            f"'{path}' is not a readable mappo checkpoint ({type(err).__name__}); "
            "pick another file in checkpoints/"
        ) from err
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"'{path}' is not a mappo checkpoint (format {CHECKPOINT_FORMAT})")
    return data


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of a run directory."""
    run_dir = Path(run_dir)
    ckpts = sorted((run_dir / "checkpoints").glob("iter_*.pt"))
    if not ckpts:
        raise CheckpointError(
            f"no checkpoint in '{run_dir / 'checkpoints'}'; is '{run_dir}' a mappo run directory?"
        )
    return ckpts[-1]


def _task_dir(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.replace(":", "/"))


def _step_to_dict(step: EnvStep) -> dict[str, Any]:
    return {
        "obs": step.obs,
        "state": step.state,
        "alive": step.alive,
        "action_mask": step.action_mask,
        "agent_state": step.agent_state,
    }


def _step_from_dict(d: dict[str, Any], device: torch.device) -> EnvStep:
    def to(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: to(v) for k, v in x.items()}
        return x.to(device)

    E = d["state"].shape[0]
    zeros = torch.zeros(E, dtype=torch.bool, device=device)
    return EnvStep(
        obs=to(d["obs"]),
        state=to(d["state"]),
        reward={k: torch.zeros_like(v, dtype=torch.float32) for k, v in to(d["alive"]).items()},
        terminated=zeros,
        truncated=zeros.clone(),
        alive=to(d["alive"]),
        action_mask=to(d["action_mask"]),
        agent_state=to(d["agent_state"]),
    )


# -- the trainer ------------------------------------------------------------------------------


class Trainer:
    """Owns the env, the policy, the optimisers and the run directory of one training run."""

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
        self.policy = build_policy(self.env, cfg)
        self.optim = Optimizers.create(self.policy, cfg.algo)
        self.recurrent = cfg.model.recurrent != "none"
        self.sample_gen = _generator(self.device, cfg.seed + 1)
        self.shuffle_gen = _generator(torch.device("cpu"), cfg.seed + 2)
        self.iteration = 0
        self.env_steps = 0
        self.wall_offset = 0.0
        self.eval_count = 0
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}

        first = self.env.reset(seed=cfg.seed)
        # The trainer's own actions are always well formed; skip the per-step checks.
        self.env.validate_actions = False
        rollout = allocate(self.policy, self.env, cfg.rollout_length, cfg.algo.bootstrap_truncation)
        actor_states, critic_states = self.policy.initial_states(self.env.num_envs, self.device)
        self.collector = Collector(
            env=self.env,
            policy=self.policy,
            rollout=rollout,
            generator=self.sample_gen,
            step=first,
            actor_states=actor_states,
            critic_states=critic_states,
            starts=torch.ones(self.env.num_envs, dtype=torch.bool, device=self.device),
            tracker=EpisodeTracker.create(self.env.num_envs, self.env.spec.stat_names, self.device),
            bootstrap=cfg.algo.bootstrap_truncation,
        )
        if checkpoint is not None:
            self._restore(checkpoint)
        self.run_dir = run_dir

    # -- one iteration ------------------------------------------------------------------------
    def iterate(self) -> dict[str, float]:
        """Collect one rollout and update once; returns timings and losses."""
        cfg = self.cfg
        if cfg.algo.lr_decay:
            self.optim.set_lr_fraction(1.0 - self.iteration / cfg.num_updates, cfg.algo)
        t0 = time.perf_counter()
        self.policy.eval()
        rollout = self.collector.collect()
        t1 = time.perf_counter()
        self.policy.train()
        samples = make_samples(self.policy, rollout, cfg.algo, self.recurrent)
        losses = update(self.policy, samples, self.optim, cfg.algo, self.shuffle_gen)
        t2 = time.perf_counter()
        self.iteration += 1
        self.env_steps += cfg.steps_per_update
        return {"rollout_seconds": t1 - t0, "update_seconds": t2 - t1, **losses}

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, wall_seconds: float) -> dict[str, Any]:
        c = self.collector
        try:
            env_state: dict[str, Tensor] | None = self.env.get_state()
        except NotImplementedError:
            env_state = None
        t = c.tracker
        return {
            "format": CHECKPOINT_FORMAT,
            "config": config_mod.to_dict(self.cfg),
            "spec": spec_to_dict(self.env.spec),
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "wall_seconds": wall_seconds,
            "eval_count": self.eval_count,
            "last_eval": self.last_eval,
            "policy": self.policy.state_dict(),
            "optim_actor": self.optim.actor.state_dict(),
            "optim_critic": self.optim.critic.state_dict(),
            "rng": {
                "sample": self.sample_gen.get_state(),
                "shuffle": self.shuffle_gen.get_state(),
                "env": self.env.generator.get_state(),
            },
            "env_state": env_state,
            "step": _step_to_dict(c.step),
            "actor_states": c.actor_states,
            "critic_states": c.critic_states,
            "starts": c.starts,
            "tracker": {
                "returns": t.returns,
                "lengths": t.lengths,
                "finished": t.finished,
                "return_sum": t.return_sum,
                "length_sum": t.length_sum,
                "stat_sums": t.stat_sums,
            },
        }

    def _restore(self, ckpt: dict[str, Any]) -> None:
        dev = self.device
        self.policy.load_state_dict(ckpt["policy"])
        self.optim.actor.load_state_dict(ckpt["optim_actor"])
        self.optim.critic.load_state_dict(ckpt["optim_critic"])
        self.iteration = int(ckpt["iteration"])
        self.env_steps = int(ckpt["env_steps"])
        self.wall_offset = float(ckpt["wall_seconds"])
        self.eval_count = int(ckpt["eval_count"])
        self.last_eval = dict(ckpt["last_eval"])
        self.sample_gen.set_state(ckpt["rng"]["sample"])
        self.shuffle_gen.set_state(ckpt["rng"]["shuffle"])
        c = self.collector
        if ckpt["env_state"] is not None:
            self.env.set_state({k: v.to(dev) for k, v in ckpt["env_state"].items()})
            self.env.generator.set_state(ckpt["rng"]["env"])
            c.step = _step_from_dict(ckpt["step"], dev)
            c.actor_states = {k: v.to(dev) for k, v in ckpt["actor_states"].items()}
            c.critic_states = {k: v.to(dev) for k, v in ckpt["critic_states"].items()}
            c.starts = ckpt["starts"].to(dev)
            for name, value in ckpt["tracker"].items():
                if name == "stat_sums":
                    c.tracker.stat_sums = {k: v.to(dev) for k, v in value.items()}
                else:
                    setattr(c.tracker, name, value.to(dev))
        else:
            # An environment that cannot be snapshotted (e.g. a third-party one in worker
            # processes) starts fresh episodes; the model and optimisers resume exactly.
            c.step = self.env.reset(seed=self.cfg.seed + self.iteration)

    def save_checkpoint(self, wall_seconds: float) -> Path:
        assert self.run_dir is not None
        ckpt_dir = self.run_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = ckpt_dir / f"iter_{self.iteration:08d}.pt"
        _atomic_save(self.state_dict(wall_seconds), path)
        old = sorted(ckpt_dir.glob("iter_*.pt"))[: -self.cfg.keep_checkpoints]
        for p in old:
            p.unlink()
        return path

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
        while self.iteration < cfg.num_updates:
            result = self.iterate()
            for k in timings:
                timings[k] += result.pop(k)
            last = self.iteration >= cfg.num_updates
            evaluating = last or (cfg.eval_interval and self.iteration % cfg.eval_interval == 0)
            logging_now = last or self.iteration % cfg.log_interval == 0 or evaluating
            if logging_now:
                train = self.collector.tracker.read()
                if "episode_return" in train:
                    self.last_train = train
                elapsed = time.perf_counter() - time_at_start
                sps = (self.env_steps - steps_at_start) / max(elapsed, 1e-9)
                metrics: dict[str, float] = {
                    "iteration": float(self.iteration),
                    "wall_seconds": time.perf_counter() - start,
                    "steps_per_second": sps,
                    "actor_lr": self.optim.actor.param_groups[0]["lr"],
                    "critic_lr": self.optim.critic.param_groups[0]["lr"],
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
                self.save_checkpoint(time.perf_counter() - start)
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
    cfg = config_mod.from_dict(ckpt["config"])
    if overrides:
        cfg = config_mod.apply(
            cfg, config_mod.parse_overrides(overrides) if isinstance(overrides, list) else overrides
        )
    trainer = Trainer(cfg, checkpoint=ckpt)
    trainer.run_dir = path
    config_mod.save(cfg, path / "config.yaml")
    return _run(trainer, resume_step=trainer.env_steps)


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
