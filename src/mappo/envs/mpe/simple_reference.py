"""``simple_reference``, the MAPPO paper's "Reference": two agents guide each other to goals.

Each agent has a goal landmark that the *other* agent must reach; it sees its goal's colour and
the other agent's message, and both moves and speaks (10 messages). Agents have size 0.05 and do
not collide. Reset order as in the paper's MPE: agent 0's goal, agent 1's goal, agent positions
uniform in ``[-1, 1]^2``, landmark positions uniform in ``[-0.8, 0.8]^2``.

Rewards:

- ``reward="paper"`` (default): agent ``i``'s own reward is ``-|p_other - p_goal(i)|^2``; the
  collaborative world gives every agent the sum over the two agents.
- ``reward="pettingzoo"``: mpe2's ``simple_reference_v3``, agent ``i`` gets
  ``(1 - local_ratio) * mean_j(-d_j) + local_ratio * (-d_i)`` with the *unsquared* distance
  ``d_i = |p_other - p_goal(i)|`` (``local_ratio`` 0.5 by default).

Actions: ``(move, message)`` heads ``(5, 10)`` with the paper's move signs (1 +x, 2 -x, 3 +y,
4 -y), or with ``continuous_actions=True`` mpe2's ``Box(0, 1, (15,))`` per agent, float32
``[E, 2, 15]`` in ``[0, 1]``: components 0-4 move, ``[no-op, -x, +x, -y, +y]``, with the force
``5 * (a[2] - a[1], a[4] - a[3])`` in world units (``a[0]`` has no effect); components 5-14 are
the message, which becomes the agent's communication state as it is, so the other agent observes
these 10 numbers instead of a one-hot (mpe2's ``SimpleEnv._set_action``). ``physics="pettingzoo"``
integrates in mpe2's order (see :mod:`mappo.envs.mpe.core`); with it, ``reward="pettingzoo"`` and
continuous actions the env matches ``mpe2.simple_reference_v3.env(continuous_actions=True)`` step
for step from the same state (mpe2 draws landmarks in ``[-1, 1]^2``; resets here keep the
paper's range).

Episode statistics, reported every step and read at the step that ends the episode:
``goal_distance`` (the mean over agents of the distance from the other agent to this agent's goal
landmark, at that step) and ``goals_reached`` (how many of the two goals have their agent closer
than 0.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.base import EnvError, EnvSpec, GroupSpec
from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec, sub_into
from mappo.envs.mpe.params import check_choice, check_int, check_unit_interval

LANDMARK_COLORS = ((0.75, 0.25, 0.25), (0.25, 0.75, 0.25), (0.25, 0.25, 0.75))
GOAL_RADIUS = 0.1
"""A goal counts as reached when the agent sent there is closer than this."""
REWARD_CONVENTIONS = ("paper", "pettingzoo")


class SimpleReference(ParticleEnv):
    """Batched ``simple_reference``: one group ``agents`` of 2 with action
    ``ActionSpec((5, 10))`` (move, message), or a box ``[0, 1]^15`` with ``continuous_actions``
    (see the module docstring). Observation of agent ``i`` (21 floats):
    ``[vel_i, p_l - p_i for each landmark, colour of i's goal, c of the other agent]``. Global
    state: both observations concatenated (42 floats)."""

    name = "mpe/simple_reference"
    landmark_spawn_scale = 0.8

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        episode_length: int = 25,
        reward: str = "paper",
        local_ratio: float | None = None,
        continuous_actions: bool = False,
        physics: str = "paper",
        time_feature: bool = False,
    ) -> None:
        """``reward``, ``local_ratio`` (default 0.5, only with ``reward="pettingzoo"``),
        ``continuous_actions`` and ``physics`` as in the module docstring; ``time_feature`` as in
        :mod:`mappo.envs.mpe.core`."""
        limit = check_int(self.name, "episode_length", episode_length, low=1)
        self.reward_convention = check_choice(self.name, "reward", reward, REWARD_CONVENTIONS)
        if local_ratio is not None and reward != "pettingzoo":
            raise EnvError(
                f"{self.name}: local_ratio applies only to reward='pettingzoo' "
                f"(got reward={reward!r}); drop local_ratio or set reward='pettingzoo'"
            )
        self.local_ratio = (
            0.5
            if local_ratio is None
            else check_unit_interval(self.name, "local_ratio", local_ratio)
        )
        super().__init__(
            num_envs,
            device,
            seed,
            continuous_actions=continuous_actions,
            physics=physics,
            time_feature=time_feature,
        )
        n, m, dim_c = 2, len(LANDMARK_COLORS), 10
        self.obs_dim = 2 + 2 * m + 3 + dim_c
        action = self._action_spec(moves=True, dim_c=dim_c)
        self.spec = EnvSpec(
            groups={"agents": GroupSpec(("agent_0", "agent_1"), (self.obs_dim,), action)},
            state_shape=(n * self.obs_dim,),
            episode_limit=limit,
            stat_names=("goal_distance", "goals_reached"),
        )
        world = WorldSpec(
            agent_size=(0.05, 0.05),
            agent_movable=(True, True),
            agent_collide=(False, False),
            agent_silent=(False, False),
            landmark_size=(0.05,) * m,
            landmark_collide=(False,) * m,
            dim_c=dim_c,
        )
        dev = self.device
        self._colors = torch.tensor(LANDMARK_COLORS, device=dev).t().contiguous()  # [3, L]
        self._other = torch.tensor([1, 0], device=dev)
        # Feature-major observation scratch [N, 21, E]: velocity, landmarks relative to the
        # agent, the goal's colour, the other agent's message.
        self._buf = torch.zeros(n, self.obs_dim, num_envs, device=dev)
        self._lm_rel = self._buf[:, 2 : 2 + 2 * m].view(n, m, 2, num_envs)
        self._goal_color = self._buf[:, 2 + 2 * m : 5 + 2 * m]
        self._heard = self._buf[:, 5 + 2 * m :]
        self._init_world(world, limit)

    def _extra_fields(self) -> dict[str, StateField]:
        return {"goal_landmark": StateField((2,), torch.int64, 0, self.world.num_landmarks)}

    def _sample_extras(self) -> dict[str, Tensor]:
        # Internal layout [2 (agent), E]: agent 0's goal drawn before agent 1's.
        return {"goal_landmark": self._randint(self.world.num_landmarks, 2)}

    def _split_actions(self, actions: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
        return self._move_and_message(actions["agents"], moves=True, speaks=True)

    def _observe(self) -> tuple[dict[str, Tensor], Tensor]:
        s = self._state
        n, e, buf = 2, self.num_envs, self._buf
        pos = s["agent_pos"].transpose(0, 1)  # [N, 2, E]
        vel = s["agent_vel"].transpose(0, 1)
        landmarks = s["landmark_pos"].transpose(0, 1).unsqueeze(0)
        goal_color = self._colors.index_select(1, s["goal_landmark"].reshape(-1)).view(3, n, e)
        heard = s["agent_comm"].index_select(1, self._other).transpose(0, 1)
        if torch.compiler.is_compiling():
            # New tensors instead of the scratch buffer's views (SimpleSpread._relative: views
            # written inside a graph are rebuilt around every call of it).
            lm_rel = (landmarks - pos.unsqueeze(1)).flatten(1, 2)
            parts = [vel, lm_rel, goal_color.transpose(0, 1), heard]
            state = torch.cat(parts, 1).view(n * self.obs_dim, e).t().contiguous()
            return {"agents": state.view(e, n, self.obs_dim)}, state
        buf[:, 0:2] = vel
        sub_into(self._lm_rel, landmarks, pos.unsqueeze(1))
        self._goal_color.copy_(goal_color.transpose(0, 1))
        self._heard.copy_(heard)
        state = buf.view(n * self.obs_dim, e).t().clone(memory_format=torch.contiguous_format)
        return {"agents": state.view(e, n, self.obs_dim)}, state

    def _reward_and_stats(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        s = self._state
        goal = s["goal_landmark"].unsqueeze(0).expand(2, 2, self.num_envs)
        target = s["landmark_pos"].gather(1, goal)  # [2 (xy), 2 (agent), E]: p_goal(i)
        # Agent i's goal is where the other agent must go.
        delta = s["agent_pos"].index_select(1, self._other) - target
        dist2 = delta[0].square() + delta[1].square()  # [2, E]
        dist = dist2.sqrt()
        if self.reward_convention == "paper":
            shared = dist2.sum(0).neg_()
            reward = shared.unsqueeze(1).expand(-1, 2).contiguous()
        else:
            # mpe2: (1 - local_ratio) * the mean of the agents' -d plus local_ratio * own -d.
            mean = dist.mean(0, keepdim=True)
            reward = (
                torch.add(dist.mul(-self.local_ratio), mean, alpha=self.local_ratio - 1.0)
                .t()
                .contiguous()
            )
        stats = {
            "goal_distance": dist.mean(0),
            "goals_reached": (dist < GOAL_RADIUS).sum(0, dtype=torch.float32),
        }
        return {"agents": reward}, stats

    def _render_info(
        self, env_index: int
    ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], list[str]]:
        goals = [int(g) for g in self._state["goal_landmark"][:, env_index]]
        # As the reference renderer: each agent wears the colour of the landmark it must reach,
        # which is the other agent's goal.
        agent_colors = [LANDMARK_COLORS[goals[1]], LANDMARK_COLORS[goals[0]]]
        lines = [f"agent_{i} says {self._said(i, env_index)}" for i in range(2)]
        return agent_colors, list(LANDMARK_COLORS), lines
