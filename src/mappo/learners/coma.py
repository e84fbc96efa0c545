"""COMA's half of a run: actors, the counterfactual critic and its target, two optimisers and
on-policy episode collection (no replay: each batch of episodes is used once).

One iteration plays one episode per env, trains the critic on them backwards in time, one step
per time step (PyMARL's ``critic_train_mode: seq``), copies the critic to its target every
``target_update_interval`` critic steps, and takes one actor step (:mod:`mappo.algos.coma`).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from mappo.algos.coma import actor_loss, coma_advantage, final_step_mask
from mappo.algos.mappo import grad_norm, load_optimizer_state
from mappo.algos.returns import lambda_targets
from mappo.algos.value import epsilon_at, make_optimizer
from mappo.checkpoint import restore_generator
from mappo.config import ComaConfig, TrainConfig
from mappo.data import EpisodeBatch
from mappo.envs.base import BatchedEnv
from mappo.episodes import EpisodeCollector, collection_seed
from mappo.learners.ppo import clock, generator
from mappo.nn.coma import ComaNetworks, coma_policy
from mappo.rollout import EpisodeTracker


class ComaLearner:
    """Owns the COMA networks, the target critic, both optimisers, the acting generator, the
    critic-step counters and the tracker; saves and restores them itself."""

    def __init__(self, cfg: TrainConfig, env: BatchedEnv) -> None:
        assert isinstance(cfg.algo, ComaConfig)
        self.cfg = cfg
        self.algo: ComaConfig = cfg.algo
        self.device = env.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.policy = ComaNetworks(env.spec, cfg.model, cfg.algo).to(env.device)
        self.group = next(iter(env.spec.groups))
        self.target_critic = copy.deepcopy(self.policy.critic).requires_grad_(False)
        self.actor_optim = make_optimizer(list(self.policy.agents.parameters()), self.algo)
        self.critic_optim = make_optimizer(
            list(self.policy.critic.parameters()), self.algo, lr=self.algo.critic_lr
        )
        self.act_gen = generator(self.device, cfg.seed + 1)
        # Every collection resets the envs with its own seed: no env state is carried over.
        env.validate_actions = False
        self.env = env
        self.tracker = EpisodeTracker.create(env.num_envs, env.spec.stat_names, self.device)
        self.collector = EpisodeCollector(env, self.policy, self.act_gen, self.tracker)
        self.critic_steps = 0
        self.last_target_update = 0
        self.epsilon = self.algo.epsilon_start

    def iterate(self, iteration: int, env_steps: int) -> dict[str, float]:
        self.epsilon = epsilon_at(env_steps, self.algo)
        t0 = time.perf_counter()
        self.policy.eval()
        episodes, steps = self.collector.collect(
            self.epsilon, collection_seed(self.cfg.seed, iteration)
        )
        T = int(episodes.filled.sum(0).max())
        batch = episodes.map(lambda x: x[: T + 1])
        t1 = clock(self.device)
        self.policy.train()
        metrics = self._train(batch)
        t2 = clock(self.device)
        return {
            "env_steps": steps,
            "rollout_seconds": t1 - t0,
            "update_seconds": t2 - t1,
            **metrics,
        }

    def _train(self, b: EpisodeBatch) -> dict[str, float]:
        algo, g, critic = self.algo, self.group, self.policy.critic
        obs, actions = b.obs[g], b.actions[g][..., 0]  # [T + 1, B, n, ...], [T + 1, B, n]
        mask = b.action_mask.get(g)
        logits = self.policy.unroll(b.obs, b.actions)[g]  # [T + 1, B, n, A]
        probs = coma_policy(logits, mask, self.epsilon, algo.mask_before_softmax)
        final = final_step_mask(b.ends)  # [T + 1, B]
        with torch.no_grad():
            # No action is taken at a final observation: the critic's joint-action input there
            # holds the policy's most likely actions, and its value is the policy's expectation.
            critic_actions = torch.where(final[..., None], probs.argmax(-1), actions)
            x = critic.inputs(b.state, obs, critic_actions)  # [T + 1, B, n, in]
            q_target = self.target_critic(x)
            taken = q_target.gather(-1, critic_actions.unsqueeze(-1)).squeeze(-1)
            expected = (q_target * probs).sum(-1)
            values = torch.where(final[..., None], expected, taken)  # [T + 1, B, n]
            n = values.shape[-1]
            rewards = b.reward[:-1].unsqueeze(-1).expand(-1, -1, n)
            targets = lambda_targets(
                rewards,
                values[1:],
                b.terminated[:-1] if algo.bootstrap_truncation else b.ends[:-1],
                b.ends[:-1],
                algo.gamma,
                algo.td_lambda,
            )  # [T, B, n]
        filled = b.filled[:-1].unsqueeze(-1).expand(-1, -1, n).to(targets.dtype)
        critic_params = list(critic.parameters())
        # Sums stay tensors: no host synchronisation per critic step.
        critic_loss_sum = critic_norm_sum = torch.zeros((), device=targets.device)
        T = targets.shape[0]
        for t in range(T - 1, -1, -1):
            q_t = critic(x[t]).gather(-1, actions[t].unsqueeze(-1)).squeeze(-1)  # [B, n]
            w = filled[t]
            loss = ((q_t - targets[t]).square() * w).sum() / w.sum().clamp_min(1.0)
            self.critic_optim.zero_grad(set_to_none=True)
            loss.backward()
            critic_norm_sum = critic_norm_sum + grad_norm(critic_params, algo.max_grad_norm)
            self.critic_optim.step()
            critic_loss_sum = critic_loss_sum + loss.detach()
            self.critic_steps += 1
            if self.critic_steps - self.last_target_update >= algo.target_update_interval:
                self.target_critic.load_state_dict(critic.state_dict())
                self.last_target_update = self.critic_steps
        with torch.no_grad():
            q = critic(x[:-1])  # [T, B, n, A]
        advantages = coma_advantage(q, probs[:-1].detach(), actions[:-1])
        loss, entropy = actor_loss(probs[:-1], actions[:-1], advantages, filled, algo.entropy_coef)
        self.actor_optim.zero_grad(set_to_none=True)
        loss.backward()
        actor_norm = grad_norm(list(self.policy.agents.parameters()), algo.max_grad_norm)
        self.actor_optim.step()
        count = filled.sum().clamp_min(1.0)
        return {
            "critic_loss": float(critic_loss_sum) / T,
            "critic_grad_norm": float(critic_norm_sum) / T,
            "actor_loss": float(loss.detach()),
            "actor_grad_norm": float(actor_norm),
            "entropy": float(entropy.detach()),
            "advantage_mean": float((advantages * filled).sum() / count),
            "q_taken_mean": float(
                (q.gather(-1, actions[:-1].unsqueeze(-1)).squeeze(-1) * filled).sum() / count
            ),
            "target_mean": float((targets * filled).sum() / count),
        }

    def schedule_metrics(self) -> dict[str, float]:
        return {
            "actor_lr": self.actor_optim.param_groups[0]["lr"],
            "critic_lr": self.critic_optim.param_groups[0]["lr"],
            "epsilon": self.epsilon,
        }

    def state_dict(self, periodic: bool = True) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "target_critic": self.target_critic.state_dict(),
            "optim": {
                "actor": self.actor_optim.state_dict(),
                "critic": self.critic_optim.state_dict(),
            },
            "rng": {"act": self.act_gen.get_state()},
            "critic_steps": self.critic_steps,
            "last_target_update": self.last_target_update,
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        self.policy.load_state_dict(state["policy"])
        self.target_critic.load_state_dict(state["target_critic"])
        load_optimizer_state(self.actor_optim, state["optim"]["actor"])
        load_optimizer_state(self.critic_optim, state["optim"]["critic"])
        restore_generator(self.act_gen, state["rng"]["act"], self.cfg.seed, iteration, "act")
        self.critic_steps = int(state["critic_steps"])
        self.last_target_update = int(state["last_target_update"])
        self.tracker.load_state_dict(state["tracker"])
