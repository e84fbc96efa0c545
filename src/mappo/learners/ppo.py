"""MAPPO's half of a run: the actor-critic, its two optimisers and the rollout collector.

One iteration collects ``rollout_length`` steps in each of ``env.num_envs`` envs and updates the
networks on them (:mod:`mappo.algos.mappo`). The loop around it (logging, evaluation,
checkpoints) is the same for every family (:mod:`mappo.trainer`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mappo.algos.mappo import (
    Optimizers,
    eager_gradient_step,
    gradient_step,
    gradient_step_key,
    loss_terms,
    make_samples,
    update,
)
from mappo.checkpoint import restore_generator
from mappo.compiled import (
    AUTO_CPU_STEPS,
    BLOCK_MIN_ROLLOUT_STEPS,
    MAX_COMPILED_CHUNK,
    ROLLOUT_BLOCK,
    compile_fn,
    compile_seconds,
    compiles_gradient_step,
    fuses_env_step,
    wanted,
)
from mappo.config import TrainConfig
from mappo.data import Rollout
from mappo.envs.base import BatchedEnv
from mappo.nn.actor_critic import ActorCritic
from mappo.rollout import (
    Collector,
    EpisodeTracker,
    allocate,
    fused_step,
    fused_step_key,
    fused_steps,
    fused_steps_key,
    policy_step,
    policy_step_key,
    rollout_values,
    values_key,
)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has done the work queued on it: a GPU runs behind
    the host, so without the wait a phase's kernels would be timed in the next phase (the
    rollout's in the update's). Once per phase an iteration."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator of its own (runs never share torch's global random state)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def cpu_pays(cfg: TrainConfig, env: BatchedEnv) -> bool:
    """Whether ``compile=auto`` compiles on the CPU: a run of at least
    :data:`~mappo.compiled.AUTO_CPU_STEPS` env steps on the CPU of an env that offers traced
    steps (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_step`, the particle world), where the
    gains were measured, for one run (its step compiled with the policy) and for stacked seeds
    (BENCHMARKS.md, "Compiled path" and "Many seeds")."""
    return env.device.type == "cpu" and traces(env) and cfg.total_env_steps >= AUTO_CPU_STEPS


def traces(env: BatchedEnv) -> bool:
    """Whether ``env`` may hand the rollout traced steps (it implements
    :meth:`~mappo.envs.base.BatchedEnv.claim_traced_step`)."""
    return type(env).claim_traced_step is not BatchedEnv.claim_traced_step


def fuse_env_steps(
    collector: Collector, env: BatchedEnv, cfg: TrainConfig, recurrent: bool, envs_per_run: int
) -> None:
    """Compile ``collector``'s env steps with its policy step (one graph per step, and blocks of
    :data:`~mappo.compiled.ROLLOUT_BLOCK` steps for long feed-forward runs) where ``env`` lets
    its step be traced and the device gains from it (:func:`~mappo.compiled.fuses_env_step`).
    No CUDA graphs: these graphs mutate the env's state in place. ``envs_per_run`` counts one
    run's envs (one seed's, for stacked seeds)."""
    if not (traces(env) and fuses_env_step(env.device, recurrent)):
        return
    fallback, cpu = cfg.compile == "auto", env.device.type == "cpu"
    # Without torch's guard check on the CPU, where it was measured (mappo.compiled.DirectCalls)
    direct = fused_step_key if cpu else None
    collector.fused_fn = compile_fn(
        fused_step, fallback=fallback, mutates=True, cpp_wrapper=cpu, direct=direct
    )
    if not recurrent and cfg.total_env_steps // envs_per_run >= BLOCK_MIN_ROLLOUT_STEPS:
        collector.block_fn = compile_fn(
            fused_steps,
            fallback=fallback,
            mutates=True,
            cpp_wrapper=cpu,
            direct=fused_steps_key if cpu else None,
        )
        collector.block = ROLLOUT_BLOCK


class PPOLearner:
    """Collects rollouts and runs the MAPPO update; owns everything that a checkpoint restores
    for it (networks, optimisers, sampling and shuffling generators, the collector)."""

    def __init__(self, cfg: TrainConfig, env: BatchedEnv) -> None:
        self.cfg = cfg
        self.device = env.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.policy = ActorCritic(env.spec, cfg.model, cfg.algo).to(env.device)
        self.optim = Optimizers.create(self.policy, cfg.algo)
        self.recurrent = cfg.model.recurrent != "none"
        self.sample_gen = generator(self.device, cfg.seed + 1)
        self.shuffle_gen = generator(torch.device("cpu"), cfg.seed + 2)
        first = env.reset(seed=cfg.seed)
        # The trainer's own actions are always well formed; skip the per-step checks.
        env.validate_actions = False
        rollout = allocate(self.policy, env, cfg.rollout_length, cfg.algo.bootstrap_truncation)
        actor_states, critic_states = self.policy.initial_states(env.num_envs, self.device)
        self.collector = Collector(
            env=env,
            policy=self.policy,
            rollout=rollout,
            generator=self.sample_gen,
            step=first,
            actor_states=actor_states,
            critic_states=critic_states,
            starts=torch.ones(env.num_envs, dtype=torch.bool, device=self.device),
            tracker=EpisodeTracker.create(env.num_envs, env.spec.stat_names, self.device),
            bootstrap=cfg.algo.bootstrap_truncation,
        )
        # The compiled path (mappo.compiled): the same functions, compiled on first use.
        self.compiled = wanted(cfg.compile, self.device, cpu_pays(cfg, env))
        self.terms_fn = None
        self.step_fn = None
        if self.compiled:
            graphs = self.device.type == "cuda"
            cpu = self.device.type == "cpu"
            fallback = cfg.compile == "auto"
            self.collector.step_fn = compile_fn(
                policy_step,
                graphs,
                fallback,
                cpp_wrapper=cpu,
                direct=policy_step_key if cpu else None,  # DirectCalls: measured on the CPU
            )
            fuse_env_steps(self.collector, env, cfg, self.recurrent, env.num_envs)
            if cpu:
                # The feed-forward critics' values after each rollout, one graph. With C++
                # calls of its kernels like the other CPU graphs: its kernels then share their
                # precompiled header (about 8 s of a cold compile for each kind).
                self.collector.values_fn = compile_fn(
                    rollout_values, fallback=fallback, cpp_wrapper=True, direct=values_key
                )
            if compiles_gradient_step(self.device, self.recurrent):
                # The whole gradient step (loss, gradients, clipping, Adam) as one graph.
                self.step_fn = compile_fn(
                    gradient_step,
                    fallback=fallback,
                    eager=eager_gradient_step,
                    mutates=True,
                    cpp_wrapper=cpu,
                    direct=gradient_step_key if cpu else None,
                )
            elif not self.recurrent or cfg.algo.data_chunk_length <= MAX_COMPILED_CHUNK:
                self.terms_fn = compile_fn(loss_terms, graphs, fallback)
        self._compile_start = compile_seconds() if self.compiled else 0.0

    @property
    def tracker(self) -> EpisodeTracker:
        return self.collector.tracker

    def last_rollout(self) -> Rollout | None:
        """The collector's last rollout (what a diverged update is checked against)."""
        return self.collector.rollout

    def iterate(self, iteration: int, env_steps: int) -> dict[str, float]:
        """Collect one rollout and update once; returns the env steps taken, timings and losses."""
        cfg = self.cfg
        if cfg.algo.lr_decay:
            self.optim.set_lr_fraction(1.0 - iteration / cfg.num_updates, cfg.algo)
        t0 = time.perf_counter()
        self.policy.eval()
        rollout = self.collector.collect()
        t1 = clock(self.device)
        self.policy.train()
        samples = make_samples(
            self.policy, rollout, cfg.algo, self.recurrent, always_inject=self.terms_fn is not None
        )
        losses = update(
            self.policy,
            samples,
            self.optim,
            cfg.algo,
            self.shuffle_gen,
            self.terms_fn,
            self.step_fn,
        )
        t2 = clock(self.device)
        out = {
            "env_steps": cfg.steps_per_update,
            "rollout_seconds": t1 - t0,
            "update_seconds": t2 - t1,
            **losses,
        }
        if self.compiled:
            # Cumulative: compilation happens in the first iterations (and on a new shape).
            out["compile_seconds"] = compile_seconds() - self._compile_start
        return out

    def schedule_metrics(self) -> dict[str, float]:
        """Learning rates now."""
        return {
            "actor_lr": self.optim.actor.param_groups[0]["lr"],
            "critic_lr": self.optim.critic.param_groups[0]["lr"],
        }

    def state_dict(self, periodic: bool = True) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "optim": self.optim.state_dict(),
            "rng": {"sample": self.sample_gen.get_state(), "shuffle": self.shuffle_gen.get_state()},
            "collector": self.collector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optim.load_state_dict(state["optim"])
        restore_generator(
            self.sample_gen, state["rng"]["sample"], self.cfg.seed, iteration, "sample"
        )
        restore_generator(
            self.shuffle_gen, state["rng"]["shuffle"], self.cfg.seed, iteration, "order"
        )
        self.collector.load_state_dict(state["collector"], fallback_seed=self.cfg.seed + iteration)
