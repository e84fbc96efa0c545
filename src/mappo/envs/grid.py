"""Spread on a grid, observed as pictures: a small image task for ``model.encoder=cnn``.

Registered name: ``grid/spread``. ``num_agents`` agents and as many targets sit on the cells of a
``size`` x ``size`` grid; each step every agent moves one cell (stay, up, down, left, right; a
move off the grid stays put; agents may share a cell). The team's shared reward each step is
minus the sum, over targets, of the grid distance (in cells, L1) from the target to its nearest
agent, divided by ``size``: the particle world's Spread (:mod:`mappo.envs.mpe`) on a grid.
Episodes last ``length`` steps and end by truncation.

Each agent sees the whole grid from where it stands, as an 8-bit picture ``[V, V, 3]`` with
``V = 2 size - 1`` (height, width, channels: the Gymnasium and PettingZoo convention) whose
centre is its own cell: channel 0 the other agents, channel 1 the targets, channel 2 the cells
off the grid (walls), 255 where something is and 0 elsewhere. The critic's global state is the
grid itself, ``[size, size, 2]`` (agents, targets). The
episode statistic ``covered`` is the share of targets with an agent on them at the last step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvSpec, EnvStep, GroupSpec
from mappo.envs.mpe.params import check_int, checked_factory
from mappo.envs.registry import register

# Moves of the five actions as (row, column) steps: stay, up, down, left, right.
_MOVES = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))
_STATE_KEYS = ("agents", "targets", "t")


class GridSpread(BatchedEnv):
    """Agents cover targets on a grid; each observes a ``[2 size - 1, 2 size - 1, 3]`` picture
    centred on itself."""

    name = "grid/spread"

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        num_agents: int = 3,
        size: int = 7,
        length: int = 20,
    ) -> None:
        super().__init__(num_envs, device, seed)
        self.num_agents = check_int(self.name, "num_agents", num_agents, low=1)
        self.size = check_int(self.name, "size", size, low=2)
        self.length = check_int(self.name, "length", length, low=1)
        n, g = self.num_agents, self.size
        if 2 * n > g * g:
            raise EnvError(
                f"{self.name}: {n} agents and {n} targets need {2 * n} cells, but a grid of "
                f"size={g} has {g * g}; raise size or lower num_agents"
            )
        self.spec = EnvSpec(
            groups={
                "agents": GroupSpec(
                    agents=tuple(f"agent_{i}" for i in range(n)),
                    obs_shape=(2 * g - 1, 2 * g - 1, 3),
                    action=ActionSpec((len(_MOVES),)),
                )
            },
            state_shape=(g, g, 2),
            episode_limit=self.length,
            stat_names=("covered",),
        )
        dev = self.device
        self.moves = torch.tensor(_MOVES, dtype=torch.int64, device=dev)
        # Cells as flat indices row * size + column: agents [E, n], targets [E, n]; steps [E].
        self.agents = torch.zeros(num_envs, n, dtype=torch.int64, device=dev)
        self.targets = torch.zeros(num_envs, n, dtype=torch.int64, device=dev)
        self.t = torch.zeros(num_envs, dtype=torch.int64, device=dev)

    # -- episodes ---------------------------------------------------------------------------
    def _new_episodes(self, where: Tensor) -> None:
        """Fresh episodes where ``where [E]``: agents and targets on distinct random cells."""
        n, cells = self.num_agents, self.size * self.size
        order = torch.rand(self.num_envs, cells, generator=self.generator, device=self.device)
        picked = order.argsort(1)[:, : 2 * n]  # 2n distinct cells per env
        w = where.unsqueeze(1)
        self.agents = torch.where(w, picked[:, :n], self.agents)
        self.targets = torch.where(w, picked[:, n:], self.targets)
        self.t = torch.where(where, 0, self.t)

    def _observe(self) -> tuple[Tensor, Tensor]:
        """Observations ``[E, n, V, V, 3]`` (``V = 2 size - 1``, each centred on its agent) and
        the state ``[E, size, size, 2]``, 0 or 255."""
        E, g = self.num_envs, self.size
        cells = g * g
        agents = F.one_hot(self.agents, cells).sum(1).float()  # [E, cells]: agents per cell
        targets = F.one_hot(self.targets, cells).amax(1).float()
        off = torch.zeros_like(targets)
        grid = torch.stack([agents, targets, off], 1).reshape(E, 3, g, g)
        # Off the grid: no agents or targets, and 1 in the wall channel.
        grid = F.pad(grid, (g - 1,) * 4)
        grid[:, 2] = F.pad(torch.zeros(g, g, device=self.device), (g - 1,) * 4, value=1.0)
        V = 2 * g - 1
        span = torch.arange(V, device=self.device)
        rows = (self.agents // g).unsqueeze(-1) + span  # [E, n, V] rows of the padded grid
        cols = (self.agents % g).unsqueeze(-1) + span
        envs = torch.arange(E, device=self.device).view(E, 1, 1, 1)
        # [E, n, V, V, 3]: advanced indices first, the channel slice last
        view = grid[envs, :, rows.unsqueeze(-1), cols.unsqueeze(-2)]
        # The viewer sits at the centre: the others there are the agents less itself.
        others = view[..., 0].clone()
        others[:, :, g - 1, g - 1] -= 1.0
        obs = torch.stack([others.clamp(max=1.0), view[..., 1], view[..., 2]], -1)
        state = torch.stack([agents.clamp(max=1.0), targets], -1).reshape(E, g, g, 2)
        return obs * 255.0, state * 255.0

    def _distance(self) -> Tensor:
        """``[E]``: the sum over targets of the L1 distance to the nearest agent, in cells."""
        g = self.size
        a_r, a_c = self.agents // g, self.agents % g  # [E, n]
        t_r, t_c = self.targets // g, self.targets % g
        d_r = (t_r.unsqueeze(2) - a_r.unsqueeze(1)).abs()  # [E, targets, agents]
        d_c = (t_c.unsqueeze(2) - a_c.unsqueeze(1)).abs()
        return (d_r + d_c).amin(2).sum(1).float()

    def _covered(self) -> Tensor:
        """``[E]``: the share of targets with an agent on their cell."""
        on = (self.targets.unsqueeze(2) == self.agents.unsqueeze(1)).any(2)
        return on.float().mean(1)

    def _result(self, reward: Tensor, truncated: Tensor, covered: Tensor) -> EnvStep:
        obs, state = self._observe()
        E, n = self.num_envs, self.num_agents
        return EnvStep(
            obs={"agents": obs},
            state=state,
            reward={"agents": reward.unsqueeze(1).expand(E, n).clone()},
            terminated=torch.zeros_like(truncated),
            truncated=truncated,
            alive={"agents": torch.ones(E, n, dtype=torch.bool, device=self.device)},
            stats={"covered": covered},
        )

    # -- the contract -----------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> EnvStep:
        self.reseed(seed)
        self._new_episodes(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        zeros = torch.zeros(self.num_envs, device=self.device)
        return self._result(zeros, torch.zeros_like(zeros, dtype=torch.bool), self._covered())

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        g = self.size
        move = self.moves[actions["agents"][..., 0]]  # [E, n, 2]
        row = (self.agents // g + move[..., 0]).clamp(0, g - 1)
        col = (self.agents % g + move[..., 1]).clamp(0, g - 1)
        self.agents = row * g + col
        self.t = self.t + 1
        reward = -self._distance() / g
        truncated = self.t >= self.length
        covered = self._covered()
        final_obs, final_state = self._observe()
        self._new_episodes(truncated)
        step = self._result(reward, truncated, covered)
        step.final_obs, step.final_state = {"agents": final_obs}, final_state
        return step

    def get_state(self) -> dict[str, Tensor]:
        return {key: getattr(self, key).clone() for key in _STATE_KEYS}

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        ids = torch.arange(self.num_envs, device=self.device) if env_ids is None else env_ids
        for key, value in state.items():
            if key not in _STATE_KEYS:
                raise EnvError(f"{self.name}: unknown state field {key!r} (fields: {_STATE_KEYS})")
            getattr(self, key)[ids] = torch.as_tensor(value, device=self.device)
        zeros = torch.zeros(self.num_envs, device=self.device)
        return self._result(zeros, torch.zeros_like(zeros, dtype=torch.bool), self._covered())

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        """The grid of env ``env_index`` as an RGB frame ``[size, size, 3]``: targets as green
        squares, agents as blue discs (a covered target shows both), grid lines in grey."""
        g = self.size
        pix = np.arange(size)
        cell = pix * g // size  # the cell each pixel row (and column) falls in
        frac = (pix * g % size) / size  # where in its cell, in [0, 1)
        ci, cj = np.meshgrid(cell, cell, indexing="ij")
        fi, fj = np.meshgrid(frac, frac, indexing="ij")
        flat = ci * g + cj
        frame = np.full((size, size, 3), 235, dtype=np.uint8)
        frame[(fi * size / g < 1) | (fj * size / g < 1)] = 200
        inner = (fi > 0.08) & (fi < 0.92) & (fj > 0.08) & (fj < 0.92)
        disc = (fi - 0.5) ** 2 + (fj - 0.5) ** 2 <= 0.35**2
        targets = np.isin(flat, self.targets[env_index].cpu().numpy())
        agents = np.isin(flat, self.agents[env_index].cpu().numpy())
        frame[targets & inner] = (90, 190, 90)
        frame[agents & disc] = (60, 90, 200)
        return frame


register(
    "grid/spread",
    checked_factory(GridSpread),
    "Spread on a grid, each agent seeing it as a picture centred on itself (model.encoder=cnn)",
)
