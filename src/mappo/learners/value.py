"""The value family's half of a run (IQL, VDN, QMIX): Q-networks and their target, the
optimiser, episode collection and the replay buffer.

One iteration plays one epsilon-greedy episode in each of ``env.num_envs`` envs, stores them,
and (once the buffer holds ``batch_size`` episodes) takes ``updates_per_iteration`` gradient
steps on batches sampled from it (:mod:`mappo.algos.value`). The targets are copied from the
online networks every ``target_update_interval`` episodes, or moved softly after every step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from mappo.algos.mappo import load_optimizer_state
from mappo.algos.value import epsilon_at, make_optimizer, update
from mappo.checkpoint import restore_generator
from mappo.config import TrainConfig, ValueConfig
from mappo.data import EpisodeBatch
from mappo.envs.base import BatchedEnv
from mappo.episodes import EpisodeBuffer, EpisodeCollector, collection_seed
from mappo.learners.ppo import clock, generator
from mappo.nn.normalizers import RunningMeanStd
from mappo.nn.q_agents import QNetworks
from mappo.rollout import EpisodeTracker


def replay_updates(
    buffer: EpisodeBuffer,
    batch_size: int,
    updates: int,
    generator: torch.Generator,
    step: Callable[[EpisodeBatch], dict[str, torch.Tensor]],
) -> dict[str, float]:
    """``updates`` calls of ``step`` on batches of ``batch_size`` episodes sampled from
    ``buffer`` (none until it holds a batch); the mean of each term they return. The terms stay
    tensors until the end: one host synchronisation per iteration, not per step."""
    if buffer.size < batch_size:
        return {}
    sums: dict[str, torch.Tensor] = {}
    for _ in range(updates):
        for k, v in step(buffer.sample(batch_size, generator)).items():
            sums[k] = sums[k] + v if k in sums else v
    return {k: float(v) / updates for k, v in sums.items()}


class ValueLearner:
    """Owns everything a checkpoint restores for the value family: online and target networks,
    optimiser, reward statistics, generators, episode counters, the buffer and the tracker."""

    def __init__(self, cfg: TrainConfig, env: BatchedEnv) -> None:
        assert isinstance(cfg.algo, ValueConfig)
        self.cfg = cfg
        self.algo: ValueConfig = cfg.algo
        self.device = env.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.policy = QNetworks(env.spec, cfg.model, cfg.algo).to(env.device)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        self.optim = make_optimizer(list(self.policy.parameters()), self.algo)
        self.reward_norm = (
            RunningMeanStd(device=self.device) if self.algo.standardise_rewards else None
        )
        self.act_gen = generator(self.device, cfg.seed + 1)
        self.sample_gen = generator(torch.device("cpu"), cfg.seed + 2)
        # The learner's own actions are always well formed; skip the per-step checks. Every
        # collection resets the envs with its own seed, so no env state is carried over.
        env.validate_actions = False
        self.env = env
        self.tracker = EpisodeTracker.create(env.num_envs, env.spec.stat_names, self.device)
        self.collector = EpisodeCollector(env, self.policy, self.act_gen, self.tracker)
        self.buffer = EpisodeBuffer(
            self.collector.batch, self.algo.buffer_size, env.byte_observations
        )
        self.episodes = 0
        self.last_target_update = 0
        self.epsilon = self.algo.epsilon_start

    def iterate(self, iteration: int, env_steps: int) -> dict[str, float]:
        """Play a batch of episodes, store them and learn from the buffer."""
        algo = self.algo
        self.epsilon = epsilon_at(env_steps, algo)
        t0 = time.perf_counter()
        self.policy.eval()
        episodes, steps = self.collector.collect(
            self.epsilon, collection_seed(self.cfg.seed, iteration)
        )
        self.buffer.add(episodes)
        self.episodes += self.env.num_envs
        t1 = clock(self.device)
        self.policy.train()
        means = replay_updates(
            self.buffer,
            algo.batch_size,
            algo.updates_per_iteration,
            self.sample_gen,
            lambda batch: update(
                self.policy, self.target, batch, self.optim, algo, self.reward_norm
            ),
        )
        if algo.target_tau is None and (
            self.episodes - self.last_target_update >= algo.target_update_interval
        ):
            self.target.load_state_dict(self.policy.state_dict())
            self.last_target_update = self.episodes
        t2 = clock(self.device)
        return {
            "env_steps": steps,
            "rollout_seconds": t1 - t0,
            "update_seconds": t2 - t1,
            **means,
        }

    def schedule_metrics(self) -> dict[str, float]:
        """Learning rate, exploration epsilon and how full the buffer is (0-1)."""
        return {
            "lr": self.optim.param_groups[0]["lr"],
            "epsilon": self.epsilon,
            "buffer_fill": self.buffer.size / self.buffer.capacity,
        }

    def state_dict(self, periodic: bool = True) -> dict[str, Any]:
        keep_buffer = self.algo.buffer_in_checkpoints or not periodic
        return {
            "policy": self.policy.state_dict(),
            "target": self.target.state_dict(),
            "optim": self.optim.state_dict(),
            "reward_norm": None if self.reward_norm is None else self.reward_norm.state_dict(),
            "rng": {"act": self.act_gen.get_state(), "sample": self.sample_gen.get_state()},
            "episodes": self.episodes,
            "last_target_update": self.last_target_update,
            "buffer": self.buffer.state_dict() if keep_buffer else None,
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        self.policy.load_state_dict(state["policy"])
        self.target.load_state_dict(state["target"])
        load_optimizer_state(self.optim, state["optim"])
        if self.reward_norm is not None and state["reward_norm"] is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])
        restore_generator(self.act_gen, state["rng"]["act"], self.cfg.seed, iteration, "act")
        restore_generator(
            self.sample_gen, state["rng"]["sample"], self.cfg.seed, iteration, "sample"
        )
        self.episodes = int(state["episodes"])
        self.last_target_update = int(state["last_target_update"])
        self.buffer.load_state_dict(state["buffer"])
        self.tracker.load_state_dict(state["tracker"])
