"""A small batched env for trainer tests: every option of the contract, cheap to learn.

Each agent sees a one-hot target among ``A`` actions (plus its own "alive" bit) and is rewarded
(shared, summed over agents) for choosing it. Options switch on what the particle world lacks:
action masks (the action ``A - 1`` is always forbidden), deaths (agent ``n - 1`` dies after step
2, so it gets ``alive = False`` and must no-op), a second head, an agent-specific state and early
termination (the episode terminates when every agent was right in one step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.base import ActionSpec, BatchedEnv, EnvSpec, EnvStep, GroupSpec


class MatchEnv(BatchedEnv):
    name = "toy/match"

    def __init__(
        self,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        num_agents: int = 2,
        num_actions: int = 4,
        episode_limit: int = 6,
        masks: bool = False,
        deaths: bool = False,
        two_heads: bool = False,
        terminate_early: bool = False,
    ) -> None:
        super().__init__(num_envs, device, seed)
        self.n, self.A, self.limit = num_agents, num_actions, episode_limit
        self.masks, self.deaths, self.two_heads = masks, deaths, two_heads
        self.terminate_early = terminate_early
        nvec = (num_actions, 2) if two_heads else (num_actions,)
        obs_dim = num_actions + 1
        group = GroupSpec(
            agents=tuple(f"agent_{i}" for i in range(num_agents)),
            obs_shape=(obs_dim,),
            action=ActionSpec(nvec),
            has_action_mask=masks,
            agent_state_shape=(num_agents * obs_dim + num_agents,),
        )
        self.spec = EnvSpec(
            {"agents": group}, (num_agents * obs_dim,), episode_limit, ("accuracy",)
        )
        E = num_envs
        self.target = torch.zeros(E, num_agents, dtype=torch.int64, device=self.device)
        self.t = torch.zeros(E, dtype=torch.int64, device=self.device)
        self.correct = torch.zeros(E, device=self.device)

    def _alive(self) -> Tensor:
        alive = torch.ones(self.num_envs, self.n, dtype=torch.bool, device=self.device)
        if self.deaths:
            alive[:, -1] = self.t < 2
        return alive

    def _observe(
        self,
        reward: Tensor,
        terminated: Tensor,
        truncated: Tensor,
        stats: dict[str, Tensor] | None = None,
    ) -> EnvStep:
        alive = self._alive()
        obs = torch.nn.functional.one_hot(self.target, self.A).float()
        obs = torch.cat([obs, alive.float().unsqueeze(-1)], -1) * alive.unsqueeze(-1)
        state = obs.flatten(1)
        eye = torch.eye(self.n, device=self.device).expand(self.num_envs, -1, -1)
        agent_state = torch.cat([state.unsqueeze(1).expand(-1, self.n, -1), eye], -1)
        step = EnvStep(
            obs={"agents": obs},
            state=state,
            reward={"agents": reward},
            terminated=terminated,
            truncated=truncated,
            alive={"agents": alive},
            agent_state={"agents": agent_state},
            stats=stats or {},
        )
        if self.masks:
            total = self.spec.groups["agents"].action.total
            mask = torch.ones(self.num_envs, self.n, total, dtype=torch.bool, device=self.device)
            mask[..., self.A - 1] = False
            # A dead agent may only take action 0 (its no-op).
            dead = ~alive
            mask[..., : self.A] &= ~dead.unsqueeze(-1)
            mask[..., 0] |= dead
            step.action_mask = {"agents": mask}
        return step

    def _new_targets(self, where: Tensor) -> None:
        high = self.A - 1 if self.masks else self.A
        fresh = torch.randint(
            0, high, self.target.shape, generator=self.generator, device=self.device
        )
        self.target = torch.where(where.unsqueeze(-1), fresh, self.target)

    def reset(self, seed: int | None = None) -> EnvStep:
        self.reseed(seed)
        every = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self._new_targets(every)
        self.t.zero_()
        self.correct.zero_()
        z = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._observe(torch.zeros(self.num_envs, self.n, device=self.device), z, z)

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        a = actions["agents"][..., 0]
        alive = self._alive()
        right = (a == self.target) & alive
        reward = right.float().sum(1, keepdim=True).expand(-1, self.n).contiguous()
        self.correct += right.float().sum(1) / alive.float().sum(1)
        self.t += 1
        terminated = right.all(1) if self.terminate_early else torch.zeros_like(right[:, 0])
        truncated = (self.t >= self.limit) & ~terminated
        done = terminated | truncated
        stats = {"accuracy": self.correct / self.t}
        self._new_targets(torch.ones_like(done))
        final = self._observe(reward, terminated, truncated, stats)
        self.t = torch.where(done, torch.zeros_like(self.t), self.t)
        self.correct = torch.where(done, torch.zeros_like(self.correct), self.correct)
        fresh = self._observe(reward, terminated, truncated, stats)

        def pick(x: Tensor, y: Tensor) -> Tensor:
            d = done.reshape(-1, *([1] * (x.dim() - 1)))
            return torch.where(d, y, x)

        out = EnvStep(
            obs={"agents": pick(final.obs["agents"], fresh.obs["agents"])},
            state=pick(final.state, fresh.state),
            reward={"agents": reward},
            terminated=terminated,
            truncated=truncated,
            alive={"agents": pick(final.alive["agents"], fresh.alive["agents"])},
            agent_state={"agents": pick(final.agent_state["agents"], fresh.agent_state["agents"])},
            final_obs=final.obs,
            final_state=final.state,
            final_agent_state=final.agent_state,
            stats=stats,
        )
        if self.masks:
            out.action_mask = {
                "agents": pick(final.action_mask["agents"], fresh.action_mask["agents"])
            }
        return out

    def get_state(self) -> dict[str, Tensor]:
        return {"target": self.target.clone(), "t": self.t.clone(), "correct": self.correct.clone()}

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        ids = slice(None) if env_ids is None else env_ids
        self.target[ids] = state["target"]
        self.t[ids] = state["t"]
        self.correct[ids] = state["correct"]
        z = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._observe(torch.zeros(self.num_envs, self.n, device=self.device), z, z)


class ReachEnv(BatchedEnv):
    """Continuous 1-D reaching: each agent moves along a line toward its own target.

    Agent ``i`` sees ``[x_i, g_i]`` (position and goal in [-1, 1]) and acts with a velocity
    ``v_i`` in the box ``[-1, 1]`` (one component); ``x_i <- clip(x_i + speed * v_i, -1, 1)``. The
    shared reward is minus the mean distance to the goals. With ``mixed`` a second, discrete
    group ("pointer", one agent, 2 actions) must name the sign of the first mover's goal (+1 when
    right), so one env has a continuous and a discrete group. Episodes are truncated at
    ``episode_limit`` steps. A learned policy reaches about -0.1 per step from about -0.67.
    """

    name = "toy/reach"

    def __init__(
        self,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        num_agents: int = 2,
        episode_limit: int = 8,
        speed: float = 0.5,
        mixed: bool = False,
        low: float = -1.0,
        high: float = 1.0,
    ) -> None:
        super().__init__(num_envs, device, seed)
        self.n, self.limit, self.speed, self.mixed = num_agents, episode_limit, speed, mixed
        groups = {
            "movers": GroupSpec(
                tuple(f"mover_{i}" for i in range(num_agents)), (2,), ActionSpec.box(low, [high])
            )
        }
        if mixed:
            groups["pointer"] = GroupSpec(("pointer_0",), (1,), ActionSpec((2,)))
        self.spec = EnvSpec(groups, (2 * num_agents,), episode_limit, ("distance",))
        E = num_envs
        self.x = torch.zeros(E, num_agents, device=self.device)
        self.goal = torch.zeros(E, num_agents, device=self.device)
        self.t = torch.zeros(E, dtype=torch.int64, device=self.device)

    def _fresh(self, where: Tensor) -> None:
        shape = (self.num_envs, self.n, 2)
        u = torch.rand(shape, generator=self.generator, device=self.device) * 2.0 - 1.0
        w = where.unsqueeze(-1)
        self.x = torch.where(w, u[..., 0], self.x)
        self.goal = torch.where(w, u[..., 1], self.goal)
        self.t = torch.where(where, torch.zeros_like(self.t), self.t)

    def _obs(self) -> dict[str, Tensor]:
        obs = {"movers": torch.stack([self.x, self.goal], -1)}
        if self.mixed:
            obs["pointer"] = self.goal[:, :1].unsqueeze(-1)
        return obs

    def _observe(self, reward: dict[str, Tensor], terminated: Tensor, truncated: Tensor) -> EnvStep:
        obs = self._obs()
        alive = {
            k: torch.ones(v.shape[:2], dtype=torch.bool, device=self.device) for k, v in obs.items()
        }
        return EnvStep(
            obs=obs,
            state=obs["movers"].flatten(1),
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            alive=alive,
        )

    def _zero_reward(self) -> dict[str, Tensor]:
        return {k: torch.zeros(v.shape[:2], device=self.device) for k, v in self._obs().items()}

    def reset(self, seed: int | None = None) -> EnvStep:
        self.reseed(seed)
        self._fresh(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        z = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._observe(self._zero_reward(), z, z)

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        self.x = (self.x + self.speed * actions["movers"][..., 0]).clamp(-1.0, 1.0)
        distance = (self.x - self.goal).abs().mean(1)
        reward = {"movers": (-distance).unsqueeze(1).expand(-1, self.n).contiguous()}
        if self.mixed:
            right = actions["pointer"][:, 0, 0] == (self.goal[:, 0] > 0).long()
            reward["pointer"] = right.float().unsqueeze(1)
        self.t += 1
        truncated = self.t >= self.limit
        terminated = torch.zeros_like(truncated)
        final = self._obs()
        final_state = final["movers"].flatten(1)
        self._fresh(truncated)
        out = self._observe(reward, terminated, truncated)
        out.final_obs, out.final_state = final, final_state
        out.stats = {"distance": distance}
        return out

    def get_state(self) -> dict[str, Tensor]:
        return {"x": self.x.clone(), "goal": self.goal.clone(), "t": self.t.clone()}

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        ids = slice(None) if env_ids is None else env_ids
        self.x[ids], self.goal[ids], self.t[ids] = state["x"], state["goal"], state["t"]
        z = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._observe(self._zero_reward(), z, z)


class TargetEnv(MatchEnv):
    """MatchEnv taking a keyword argument named like the ``python:`` scheme's own parameter."""

    def __init__(self, num_envs: int, device: str = "cpu", seed: int = 0, target: int = 0):
        super().__init__(num_envs, device, seed)
        self.target = target


def register_toy() -> None:
    from mappo.envs.registry import register

    register("toy/match", MatchEnv, "test env: pick the observed target")
    register("toy/reach", ReachEnv, "test env: move to a goal on a line (continuous actions)")
