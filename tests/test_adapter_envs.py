"""Tiny PettingZoo ParallelEnvs for the adapter tests, and their PettingZoo API conformance.

This module imports only numpy, gymnasium and pettingzoo (no torch, no mappo): worker processes
of the adapter import it to build the environments.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class TinyEnv(ParallelEnv):
    """A deterministic toy env with the features the adapter must handle.

    Args:
        n_agents: agents ``agent_0 ...`` with ``Box(obs_dim)`` observations and
            ``Discrete(n_actions)`` actions.
        scouts: extra agents ``scout_0 ...`` with ``Box(5)`` observations and
            ``MultiDiscrete([2, 3])`` actions (a second group). ``odd_one``: make the last
            ``agent_*`` a ``Box(obs_dim + 1)`` agent, so two groups share the prefix ``agent``.
        masks: ``"obs"`` (dict observations with ``action_mask``), ``"info"``, ``"step_info"``
            (in the infos of steps but not of reset) or ``None``. The allowed actions at step
            ``t`` are ``a`` with ``(a + t) % 2 == 0``, and always 0.
        leave: agent -> step at which it terminates (leaves the episode).
        max_cycles: every agent still present is truncated at this step.
        fault: ``"raise"``, ``"hang"``, ``"nan"``, ``"shape"``, ``"unknown_agent"``,
            ``"array_reward"`` (a reward of shape (1,)) at ``fault_step``, only in the copy that
            was last reset with seed ``fault_seed`` (every copy when ``None``);
            ``"ghost_rewards"``: every step rewards agents that left too (1.0 each).
        box_actions: give the agents a Box action space of shape (2, 2) in [-1, 1]^4.
    """

    metadata = {"name": "tiny_v0"}

    def __init__(
        self,
        n_agents: int = 2,
        obs_dim: int = 4,
        n_actions: int = 4,
        scouts: int = 0,
        odd_one: bool = False,
        masks: str | None = None,
        leave: dict[str, int] | None = None,
        max_cycles: int = 6,
        fault: str | None = None,
        fault_step: int = 2,
        fault_seed: int | None = None,
        box_actions: bool = False,
    ) -> None:
        self.possible_agents = [f"agent_{i}" for i in range(n_agents)]
        self.possible_agents += [f"scout_{i}" for i in range(scouts)]
        self.n_actions = n_actions
        self.masks = masks
        self.leave = dict(leave or {})
        self.max_cycles = max_cycles
        self.fault, self.fault_step, self.fault_seed = fault, fault_step, fault_seed
        self._obs_spaces: dict[str, spaces.Space] = {}
        self._act_spaces: dict[str, spaces.Space] = {}
        for i, agent in enumerate(self.possible_agents):
            if agent.startswith("scout"):
                value: spaces.Space = spaces.Box(-np.inf, np.inf, (5,), np.float32)
                action: spaces.Space = spaces.MultiDiscrete([2, 3])
            else:
                dim = obs_dim + 1 if odd_one and i == n_agents - 1 else obs_dim
                value = spaces.Box(-np.inf, np.inf, (dim,), np.float32)
                action = spaces.Discrete(n_actions)
            if box_actions:
                action = spaces.Box(-1.0, 1.0, (2, 2), np.float32)
            if masks == "obs":
                width = _width(action)
                value = spaces.Dict(
                    {"observation": value, "action_mask": spaces.MultiBinary(width)}
                )
            self._obs_spaces[agent] = value
            self._act_spaces[agent] = action
        self.agents: list[str] = []
        self.t = 0
        self.seed_used: int | None = None
        self.rng = np.random.default_rng(0)

    def observation_space(self, agent: str) -> spaces.Space:
        return self._obs_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self._act_spaces[agent]

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
            self.seed_used = seed
        self.agents = list(self.possible_agents)
        self.t = 0
        self.noise = self.rng.normal(size=len(self.possible_agents))
        self.last = {a: 0 for a in self.possible_agents}
        if self.fault == "reset_raise":
            raise RuntimeError("reset boom")
        if self.fault == "reset_obs_only":  # the old API's reset: no infos
            return {a: self._obs(a) for a in self.agents}
        if self.fault == "reset_text_obs":
            return {a: "hello" for a in self.agents}, {a: {} for a in self.agents}
        if self.fault == "reset_array_obs":  # no dict, where the space (masks="obs") is one
            return {a: np.zeros(3) for a in self.agents}, {a: {} for a in self.agents}
        return {a: self._obs(a) for a in self.agents}, {a: self._info(a) for a in self.agents}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        faulty = self.fault is not None and self.t == self.fault_step
        faulty = faulty and self.fault_seed in (None, self.seed_used)
        if faulty and self.fault == "raise":
            raise RuntimeError(f"boom at step {self.t}")
        if faulty and self.fault == "hang":
            _hang_forever()
        rewards, terms, truncs = {}, {}, {}
        for a in self.agents:
            act = actions[a]
            if isinstance(self._act_spaces[a], spaces.Box) and np.shape(act) != (2, 2):
                raise ValueError(f"a Box action of shape {np.shape(act)} reached the env")
            self.last[a] = float(np.sum(act))
            rewards[a] = 0.1 * self.last[a] + self.possible_agents.index(a)
            terms[a] = self.leave.get(a) == self.t
            truncs[a] = self.t >= self.max_cycles and not terms[a]
        obs = {a: self._obs(a) for a in self.agents}
        infos = {a: self._info(a, stepped=True) for a in self.agents}
        if faulty and self.fault == "nan":
            rewards[self.agents[-1]] = float("nan")
        if faulty and self.fault == "shape":
            obs[self.agents[0]] = np.zeros(3, np.float32)
        if faulty and self.fault == "unknown_agent":
            rewards["ghost_0"] = 1.0
        if faulty and self.fault == "array_reward":
            rewards[self.agents[0]] = np.array([1.0])
        if self.fault == "ghost_rewards":  # as envs that report every possible agent do
            rewards.update({a: 1.0 for a in self.possible_agents if a not in self.agents})
        if faulty and self.fault == "no_reward":
            del rewards[self.agents[0]]
        if faulty and self.fault == "four_tuple":  # the old API's step: one done dict
            return obs, rewards, terms, infos
        ended = [a for a in self.agents if terms[a] or truncs[a]]
        if self.fault != "stays":  # (an env that keeps its ended agents in env.agents)
            self.agents = [a for a in self.agents if a not in ended]
        return obs, rewards, terms, truncs, infos

    def state(self) -> np.ndarray:
        if self.fault == "state_raise":
            raise ValueError("state boom")
        raise NotImplementedError("TinyEnv has no global state")

    def _value(self, agent: str) -> np.ndarray:
        i = self.possible_agents.index(agent)
        dim = self._value_space(agent).shape[0]
        head = [self.t, i, self.last[agent], self.noise[i]]
        return np.resize(np.asarray(head, np.float32), dim)

    def _value_space(self, agent: str) -> spaces.Space:
        space = self._obs_spaces[agent]
        return space["observation"] if isinstance(space, spaces.Dict) else space

    def _mask(self, agent: str) -> np.ndarray:
        space = self._act_spaces[agent]
        width = _width(space)
        allowed = (np.arange(width) + self.t) % 2 == 0
        allowed[0] = True
        return allowed.astype(np.int8)

    def _obs(self, agent: str) -> object:
        if self.masks == "obs":
            return {"observation": self._value(agent), "action_mask": self._mask(agent)}
        return self._value(agent)

    def _info(self, agent: str, stepped: bool = False) -> dict:
        given = self.masks == "info" or (self.masks == "step_info" and stepped)
        return {"action_mask": self._mask(agent)} if given else {}


class ScoredTinyEnv(TinyEnv):
    """:class:`TinyEnv` that reports ``steps_played`` and ``bonus`` in every agent's info on the
    step that ends an episode (declared in ``episode_stats``), and draws itself: an
    ``[8, 12, 3]`` frame filled with ``(10 * seed + step) % 256``, or ``None`` without
    ``render_mode="rgb_array"``."""

    episode_stats = ("steps_played", "bonus")

    def __init__(
        self,
        render_mode: str | None = None,
        stat_value: object = 1.5,
        render_fault: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.render_mode = render_mode
        self.stat_value = stat_value
        self.render_fault = render_fault

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        obs, rewards, terms, truncs, infos = super().step(actions)
        if not self.agents:
            for info in infos.values():
                info.update(steps_played=self.t, bonus=self.stat_value)
        return obs, rewards, terms, truncs, infos

    def render(self) -> np.ndarray | None:
        """``render_fault``: ``"raise"`` (a RuntimeError) or ``"shape"`` (a 2-D frame)."""
        if self.render_fault == "raise":
            raise RuntimeError("no canvas")
        if self.render_fault == "shape":
            return np.zeros((8, 12), np.uint8)
        if self.render_mode != "rgb_array":
            return None
        # Each copy draws its own seed, so that a frame shows which copy drew it.
        return np.full((8, 12, 3), (10 * (self.seed_used or 0) + self.t) % 256, np.uint8)


class PictureEnv(ParallelEnv):
    """Two agents that observe 8-bit pictures ``[8, 7, 3]`` and a state that is one too
    (``[4, 4, 2]``), with ``Discrete(3)`` actions; episodes last ``max_cycles`` steps. Pixel
    ``(r, c, k)`` of agent ``i`` at step ``t`` is ``(40 t + 100 i + 7 r + 3 c + k + a) % 256``,
    ``a`` the agent's last action; its reward is 1 when ``a`` is 2. ``stateless``: no
    ``state()`` (the adapter then joins the pictures); ``unit``: float pictures in [0, 1]
    (the same values divided by 255)."""

    metadata = {"name": "picture_v0"}

    def __init__(self, max_cycles: int = 4, stateless: bool = False, unit: bool = False) -> None:
        self.possible_agents = ["painter_0", "painter_1"]
        self.unit = unit
        self.max_cycles = max_cycles
        self.stateless = stateless
        self.agents: list[str] = []
        self.t = 0
        self.last = {a: 0 for a in self.possible_agents}

    def observation_space(self, agent: str) -> spaces.Space:
        if self.unit:
            return spaces.Box(0.0, 1.0, (8, 7, 3), np.float32)
        return spaces.Box(0, 255, (8, 7, 3), np.uint8)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(3)

    def picture(self, agent: str) -> np.ndarray:
        i = self.possible_agents.index(agent)
        r, c, k = np.meshgrid(np.arange(8), np.arange(7), np.arange(3), indexing="ij")
        value = 40 * self.t + 100 * i + 7 * r + 3 * c + k + self.last[agent]
        if self.unit:
            return (value % 256).astype(np.float32) / 255
        return (value % 256).astype(np.uint8)

    def state(self) -> np.ndarray:
        if self.stateless:
            raise NotImplementedError("no state")
        return np.full((4, 4, 2), 10 * self.t, dtype=np.uint8)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.agents, self.t = list(self.possible_agents), 0
        self.last = {a: 0 for a in self.possible_agents}
        return {a: self.picture(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        self.last = {a: int(actions[a]) for a in self.agents}
        rewards = {a: float(self.last[a] == 2) for a in self.agents}
        ended = self.t >= self.max_cycles
        obs = {a: self.picture(a) for a in self.agents}
        terms = {a: False for a in self.agents}
        truncs = {a: ended for a in self.agents}
        infos = {a: {} for a in self.agents}
        if ended:
            self.agents = []
        return obs, rewards, terms, truncs, infos


def _width(space: spaces.Space) -> int:
    """Entries of a flat action mask for ``space`` (a Box's size, for the refusal test)."""
    if hasattr(space, "nvec"):
        return int(np.sum(space.nvec))
    return int(np.prod(space.shape)) if isinstance(space, spaces.Box) else int(space.n)


def _hang_forever() -> None:
    while True:
        time.sleep(0.05)


def tiny(**kwargs: object) -> functools.partial:
    """A picklable factory of :class:`TinyEnv` (what the adapters take)."""
    return functools.partial(TinyEnv, **kwargs)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (no psutil needed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_tiny_envs_follow_the_parallel_api() -> None:
    from pettingzoo.test import parallel_api_test

    for kwargs in (
        {"scouts": 1},
        {"masks": "obs"},
        {"masks": "info", "leave": {"agent_1": 2}},
    ):
        parallel_api_test(TinyEnv(**kwargs), num_cycles=20)
