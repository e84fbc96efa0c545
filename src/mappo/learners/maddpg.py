"""MADDPG's half of a run: actors, the joint critic, their targets, two optimisers, episode
collection and the replay buffer.

One iteration plays one episode in each of ``env.num_envs`` envs (discrete actions sampled and
mixed with epsilon-uniform exploration; in a box the deterministic action plus Gaussian noise),
stores them, and once the buffer holds ``batch_size`` episodes
takes ``updates_per_iteration`` update steps on batches sampled from it
(:mod:`mappo.algos.maddpg`), each followed by the targets' Polyak step.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from mappo.algos.maddpg import update
from mappo.algos.mappo import load_optimizer_state
from mappo.algos.value import epsilon_at
from mappo.checkpoint import restore_generator
from mappo.config import MaddpgConfig, TrainConfig
from mappo.envs.base import BatchedEnv
from mappo.episodes import EpisodeBuffer, EpisodeCollector, collection_seed
from mappo.learners.ppo import clock, generator
from mappo.learners.value import replay_updates
from mappo.nn.maddpg import MaddpgNetworks
from mappo.nn.normalizers import RunningMeanStd
from mappo.rollout import EpisodeTracker


class MaddpgLearner:
    """Owns everything a checkpoint restores for MADDPG: online and target networks, both
    optimisers, reward statistics, generators, the buffer and the tracker."""

    def __init__(self, cfg: TrainConfig, env: BatchedEnv) -> None:
        assert isinstance(cfg.algo, MaddpgConfig)
        self.cfg = cfg
        self.algo: MaddpgConfig = cfg.algo
        self.device = env.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.policy = MaddpgNetworks(env.spec, cfg.model, cfg.algo).to(env.device)
        self.target = copy.deepcopy(self.policy).requires_grad_(False)
        algo = self.algo
        self.actor_optim = torch.optim.Adam(
            self.policy.agents.parameters(), lr=algo.actor_lr, eps=algo.adam_eps
        )
        self.critic_optim = torch.optim.Adam(
            self.policy.critic.parameters(), lr=algo.critic_lr, eps=algo.adam_eps
        )
        self.reward_norm = RunningMeanStd(device=self.device) if algo.standardise_rewards else None
        self.act_gen = generator(self.device, cfg.seed + 1)
        self.sample_gen = generator(torch.device("cpu"), cfg.seed + 2)
        self.noise_gen = generator(self.device, cfg.seed + 3)  # the actor loss's Gumbel noise
        # The learner's own actions are always well formed; skip the per-step checks. Every
        # collection resets the envs with its own seed, so no env state is carried over.
        env.validate_actions = False
        self.env = env
        self.tracker = EpisodeTracker.create(env.num_envs, env.spec.stat_names, self.device)
        self.collector = EpisodeCollector(env, self.policy, self.act_gen, self.tracker)
        self.buffer = EpisodeBuffer(self.collector.batch, algo.buffer_size, env.byte_observations)
        self.epsilon = algo.epsilon_start

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
        t1 = clock(self.device)
        self.policy.train()
        means = replay_updates(
            self.buffer,
            algo.batch_size,
            algo.updates_per_iteration,
            self.sample_gen,
            lambda batch: update(
                self.policy,
                self.target,
                batch,
                self.actor_optim,
                self.critic_optim,
                algo,
                self.noise_gen,
                self.reward_norm,
            ),
        )
        t2 = clock(self.device)
        return {
            "env_steps": steps,
            "rollout_seconds": t1 - t0,
            "update_seconds": t2 - t1,
            **means,
        }

    def schedule_metrics(self) -> dict[str, float]:
        """Learning rates, exploration epsilon and how full the buffer is (0-1)."""
        return {
            "actor_lr": self.actor_optim.param_groups[0]["lr"],
            "critic_lr": self.critic_optim.param_groups[0]["lr"],
            "epsilon": self.epsilon,
            "buffer_fill": self.buffer.size / self.buffer.capacity,
        }

    def state_dict(self, periodic: bool = True) -> dict[str, Any]:
        keep_buffer = self.algo.buffer_in_checkpoints or not periodic
        return {
            "policy": self.policy.state_dict(),
            "target": self.target.state_dict(),
            "optim": {
                "actor": self.actor_optim.state_dict(),
                "critic": self.critic_optim.state_dict(),
            },
            "reward_norm": None if self.reward_norm is None else self.reward_norm.state_dict(),
            "rng": {
                "act": self.act_gen.get_state(),
                "sample": self.sample_gen.get_state(),
                "noise": self.noise_gen.get_state(),
            },
            "buffer": self.buffer.state_dict() if keep_buffer else None,
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        self.policy.load_state_dict(state["policy"])
        self.target.load_state_dict(state["target"])
        load_optimizer_state(self.actor_optim, state["optim"]["actor"])
        load_optimizer_state(self.critic_optim, state["optim"]["critic"])
        if self.reward_norm is not None and state["reward_norm"] is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])
        seed = self.cfg.seed
        restore_generator(self.act_gen, state["rng"]["act"], seed, iteration, "act")
        restore_generator(self.sample_gen, state["rng"]["sample"], seed, iteration, "sample")
        restore_generator(self.noise_gen, state["rng"]["noise"], seed, iteration, "noise")
        self.buffer.load_state_dict(state["buffer"])
        self.tracker.load_state_dict(state["tracker"])
