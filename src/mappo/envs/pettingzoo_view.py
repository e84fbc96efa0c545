"""One copy of a batched env seen as a PettingZoo ``ParallelEnv``.

This module needs ``pettingzoo`` and ``gymnasium`` (``pip install 'mappo[pettingzoo]'``); the rest
of the package does not import it.

Example::

    env = PettingZooView("mpe/simple_spread")
    obs, infos = env.reset(seed=0)
    while env.agents:
        actions = {a: env.action_space(a).sample() for a in env.agents}
        obs, rewards, terminations, truncations, infos = env.step(actions)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvStep
from mappo.envs.registry import make

try:
    from gymnasium import spaces
    from pettingzoo import ParallelEnv
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(
        "PettingZooView needs pettingzoo and gymnasium: pip install 'mappo[pettingzoo]'"
    ) from err


class PettingZooView(ParallelEnv):
    """A :class:`~mappo.envs.BatchedEnv` with ``num_envs == 1`` as a PettingZoo parallel env.

    Agents are all groups' agents in spec order. Observations are ``float32`` arrays in a ``Box``;
    for groups with action masks they are dicts ``{"observation", "action_mask"}`` (the PettingZoo
    convention, mask as ``int8``). Actions are ``Discrete(n)`` for one head and
    ``MultiDiscrete(nvec)`` otherwise. When the episode ends every agent leaves ``agents`` and the
    observations returned are those the episode ended on; call ``reset`` to start the next one.
    ``infos[agent]["stats"]`` holds the episode statistics at that step. Agents that the batched
    env marks as not alive stay in ``agents`` and their actions are ignored by the env.
    """

    metadata = {"name": "mappo_pettingzoo_view", "render_modes": ["rgb_array"]}

    def __init__(
        self,
        env: BatchedEnv | str,
        render_mode: str | None = "rgb_array",
        *,
        device: str | torch.device = "cpu",
        seed: int = 0,
        **env_kwargs: Any,
    ) -> None:
        """Wrap ``env``, or create ``make(env, num_envs=1, device=device, seed=seed,
        **env_kwargs)`` when ``env`` is a registered name."""
        if isinstance(env, str):
            env = make(env, num_envs=1, device=device, seed=seed, **env_kwargs)
        elif env_kwargs:
            raise EnvError(f"env parameters {sorted(env_kwargs)} only apply to an env name")
        if not isinstance(env, BatchedEnv):
            raise EnvError(f"PettingZooView wraps a BatchedEnv or an env name, got {env!r}")
        if env.num_envs != 1:
            raise EnvError(
                f"PettingZooView wraps one env copy; got {env.name} with num_envs={env.num_envs} "
                "(create it with num_envs=1)"
            )
        if render_mode not in (None, "rgb_array"):
            raise EnvError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.env = env
        self.render_mode = render_mode
        self.metadata = {**self.metadata, "name": env.name}
        self._slots: list[tuple[str, int]] = []  # agent -> (group, index in group)
        self._observation_spaces: dict[str, spaces.Space] = {}
        self._action_spaces: dict[str, spaces.Space] = {}
        for group_name, group in env.spec.groups.items():
            obs_box = spaces.Box(-np.inf, np.inf, shape=group.obs_shape, dtype=np.float32)
            if group.has_action_mask:
                mask_box = spaces.Box(0, 1, shape=(group.action.total,), dtype=np.int8)
                obs_space: spaces.Space = spaces.Dict(
                    {"observation": obs_box, "action_mask": mask_box}
                )
            else:
                obs_space = obs_box
            if group.action.continuous:
                act_space: spaces.Space = spaces.Box(
                    np.asarray(group.action.low, dtype=np.float32),
                    np.asarray(group.action.high, dtype=np.float32),
                    dtype=np.float32,
                )
            elif group.action.num_heads == 1:
                act_space = spaces.Discrete(group.action.nvec[0])
            else:
                act_space = spaces.MultiDiscrete(list(group.action.nvec))
            for k, agent in enumerate(group.agents):
                self._slots.append((group_name, k))
                self._observation_spaces[agent] = obs_space
                self._action_spaces[agent] = act_space
        self.possible_agents = [a for g in env.spec.groups.values() for a in g.agents]
        self.agents: list[str] = []
        self.state_space = spaces.Box(-np.inf, np.inf, shape=env.spec.state_shape, dtype=np.float32)
        self._state: np.ndarray | None = None

    def observation_space(self, agent: str) -> spaces.Space:
        return self._observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self._action_spaces[agent]

    def reset(
        self, seed: int | None = None, options: dict | None = None
    ) -> tuple[dict[str, Any], dict[str, dict]]:
        """Start a new episode (``options`` is accepted and ignored)."""
        step = self.env.reset(seed=seed)
        self.agents = list(self.possible_agents)
        obs = self._observations(step.obs, step)
        self._state = step.state[0].cpu().numpy().astype(np.float32, copy=False)
        return obs, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if not self.agents:
            raise EnvError("the episode has ended (no agents left); call reset() first")
        missing = [a for a in self.agents if a not in actions]
        unknown = [a for a in actions if a not in self.agents]
        if missing or unknown:
            raise EnvError(
                f"actions must be given for exactly the live agents {self.agents}; "
                f"missing {missing}, unknown {unknown}"
            )
        batch = {
            name: np.zeros((1, g.num_agents, g.action.num_heads), dtype=_numpy_dtype(g.action))
            for name, g in self.env.spec.groups.items()
        }
        for agent, (group, k) in zip(self.possible_agents, self._slots, strict=True):
            batch[group][0, k] = np.asarray(actions[agent], dtype=batch[group].dtype).reshape(-1)
        step = self.env.step({g: torch.from_numpy(a) for g, a in batch.items()})
        assert step.final_obs is not None and step.final_state is not None
        obs = self._observations(step.final_obs, step)
        self._state = step.final_state[0].cpu().numpy().astype(np.float32, copy=False)
        terminated, truncated = bool(step.terminated[0]), bool(step.truncated[0])
        rewards = {
            agent: float(step.reward[group][0, k])
            for agent, (group, k) in zip(self.possible_agents, self._slots, strict=True)
        }
        infos: dict[str, dict] = {a: {} for a in self.agents}
        if terminated or truncated:
            stats = {name: float(v[0]) for name, v in step.stats.items()}
            for info in infos.values():
                info["stats"] = stats
        terminations = {a: terminated for a in self.agents}
        truncations = {a: truncated for a in self.agents}
        if terminated or truncated:
            self.agents = []
        return obs, rewards, terminations, truncations, infos

    def state(self) -> np.ndarray:
        """The global state ``[*state_shape]`` float32 of the last reset or step."""
        if self._state is None:
            raise EnvError("call reset() before state()")
        return self._state

    def render(self) -> np.ndarray | None:
        """An RGB frame ``[H, W, 3]`` uint8 of the env's current state (``None`` without a
        render mode). After the episode's last step the env has already reset itself, so the
        frame shows the next episode's start."""
        if self.render_mode is None:
            return None
        return self.env.render(0)

    def close(self) -> None:
        self.env.close()

    def _observations(self, obs: dict[str, torch.Tensor], step: EnvStep) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for agent, (group, k) in zip(self.possible_agents, self._slots, strict=True):
            value = obs[group][0, k].cpu().numpy().astype(np.float32, copy=False)
            mask = step.action_mask.get(group)
            if mask is not None:
                out[agent] = {
                    "observation": value,
                    "action_mask": mask[0, k].cpu().numpy().astype(np.int8),
                }
            else:
                out[agent] = value
        return out


def _numpy_dtype(action: ActionSpec) -> type:
    """How a group's actions are batched: int64 indices, or float32 box components."""
    return np.float32 if action.continuous else np.int64
