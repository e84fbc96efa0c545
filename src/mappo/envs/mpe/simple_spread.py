"""``simple_spread``, the MAPPO paper's "Spread": N agents cover L landmarks without colliding.

Conventions of the paper's MPE (see the module docstring of :mod:`mappo.envs.mpe`): agents of size
0.15 collide; landmarks of size 0.05 do not; agents spawn uniformly in ``[-1, 1]^2`` and landmarks
in ``[-0.8, 0.8]^2``; episodes last 25 steps.

Rewards:

- ``reward="paper"`` (default): agent ``i``'s own reward is ``-sum_l min_a |p_a - p_l|`` minus the
  number of agents ``a`` with ``|p_a - p_i| < size_a + size_i``, a count that includes ``i``
  itself; every agent then receives the **sum** over agents (the world is "collaborative"). The
  self-collision term makes a constant ``-N`` per step, which is part of the paper's return scale.
- ``reward="pettingzoo"``: the PettingZoo / mpe2 ``simple_spread_v3`` convention, each agent gets
  ``(1 - local_ratio) * global + local_ratio * local_i`` with ``global = -sum_l min_a |p_a - p_l|``
  and ``local_i = -#{other agents colliding with i}``.

Actions: ``Discrete(5)`` moves in the paper's signs (1 +x, 2 -x, 3 +y, 4 -y), or with
``continuous_actions=True`` mpe2's ``Box(0, 1, (5,))`` per agent, float32 ``[E, N, 5]``: components
``[no-op, -x, +x, -y, +y]`` in ``[0, 1]``, the force ``5 * (a[2] - a[1], a[4] - a[3])`` in world
units (mass 1, so also the acceleration); ``a[0]`` has no effect (mpe2's
``SimpleEnv._set_action``). ``physics="pettingzoo"`` integrates in mpe2's order (see
:mod:`mappo.envs.mpe.core`); with it, ``reward="pettingzoo"`` and continuous actions the env matches
``mpe2.simple_spread_v3.env(continuous_actions=True)`` step for step from the same state.
Observations, rewards and statistics do not depend on the action type.

Episode statistics (from the scenario's benchmark data), reported every step for the episode so
far and read at the step that ends it: ``occupied_landmarks`` (landmarks with an agent closer than
0.1, at the last step), ``collisions`` (pairs of distinct agents in contact, summed over the
episode's steps) and ``sum_min_dist`` (sum over landmarks of the distance to the nearest agent, at
the last step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.base import EnvError, EnvSpec, GroupSpec
from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec, sub_into
from mappo.envs.mpe.params import check_choice, check_int, check_unit_interval

OCCUPIED_RADIUS = 0.1
"""A landmark is occupied when an agent is closer than this (the scenario's benchmark data)."""
REWARD_CONVENTIONS = ("paper", "pettingzoo")


class SimpleSpread(ParticleEnv):
    """Batched ``simple_spread``: one group ``agents`` of ``num_agents`` agents.

    Observation of agent ``i`` (``4 + 2L + 4(N-1)`` floats): ``[vel_i, pos_i, pos_l - pos_i for
    each landmark, pos_j - pos_i for each other agent j, c_j for each other agent j]`` (the
    messages ``c_j`` are zeros: agents are silent). Action: ``Discrete(5)`` move, or with
    ``continuous_actions`` a box ``[0, 1]^5`` (see the module docstring). Global state: the
    agents' observations concatenated in agent order.
    """

    name = "mpe/simple_spread"
    landmark_spawn_scale = 0.8

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        num_agents: int = 3,
        num_landmarks: int | None = None,
        reward: str = "paper",
        local_ratio: float | None = None,
        episode_length: int = 25,
        continuous_actions: bool = False,
        physics: str = "paper",
        time_feature: bool = False,
    ) -> None:
        """``num_landmarks`` defaults to ``num_agents``; ``local_ratio`` (default 0.5) applies
        only to ``reward="pettingzoo"``; ``continuous_actions`` and ``physics`` as in the module
        docstring; ``time_feature`` as in :mod:`mappo.envs.mpe.core`."""
        n = check_int(self.name, "num_agents", num_agents, low=1)
        m = n if num_landmarks is None else check_int(self.name, "num_landmarks", num_landmarks)
        check_choice(self.name, "reward", reward, REWARD_CONVENTIONS)
        if local_ratio is not None and reward != "pettingzoo":
            raise EnvError(
                f"{self.name}: local_ratio applies only to reward='pettingzoo' "
                f"(got reward={reward!r}); drop local_ratio or set reward='pettingzoo'"
            )
        self.reward_convention = reward
        self.local_ratio = (
            0.5
            if local_ratio is None
            else check_unit_interval(self.name, "local_ratio", local_ratio)
        )
        limit = check_int(self.name, "episode_length", episode_length, low=1)
        super().__init__(
            num_envs,
            device,
            seed,
            continuous_actions=continuous_actions,
            physics=physics,
            time_feature=time_feature,
        )
        dim_c = 2
        self.obs_dim = 4 + 2 * m + (2 + dim_c) * (n - 1)
        self.spec = EnvSpec(
            groups={
                "agents": GroupSpec(
                    agents=tuple(f"agent_{i}" for i in range(n)),
                    obs_shape=(self.obs_dim,),
                    action=self._action_spec(moves=True, dim_c=0),
                )
            },
            state_shape=(n * self.obs_dim,),
            episode_limit=limit,
            stat_names=("occupied_landmarks", "collisions", "sum_min_dist"),
        )
        world = WorldSpec(
            agent_size=(0.15,) * n,
            agent_movable=(True,) * n,
            agent_collide=(True,) * n,
            agent_silent=(True,) * n,
            landmark_size=(0.05,) * m,
            landmark_collide=(False,) * m,
            dim_c=dim_c,
        )
        self._init_buffers(n, m)
        self._init_world(world, limit)

    def _init_buffers(self, n: int, m: int) -> None:
        """Feature-major observation scratch ``[N, obs_dim, E]`` and views of its blocks."""
        e, dev = self.num_envs, self.device
        self._others = torch.tensor(
            [j for i in range(n) for j in range(n) if j != i], dtype=torch.long, device=dev
        )
        # The trailing block of the other agents' messages stays zero: agents are silent, and
        # set_state refuses messages for silent agents.
        self._buf = torch.zeros(n, self.obs_dim, e, device=dev)
        lm0, ag0 = 4, 4 + 2 * m
        self._lm_rel = self._buf[:, lm0:ag0].view(n, m, 2, e)
        self._other_rel = self._buf[:, ag0 : ag0 + 2 * (n - 1)].view(n, n - 1, 2, e)
        # Agents i and j collide when closer than size_i + size_j (all sizes are 0.15).
        self._collide_dist2 = (0.15 + 0.15) ** 2

    def _extra_fields(self) -> dict[str, StateField]:
        return {"episode_collisions": StateField((), torch.float32)}

    def _fresh_accumulators(self) -> dict[str, Tensor]:
        return {"episode_collisions": torch.zeros(self.num_envs, device=self.device)}

    def _split_actions(self, actions: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
        moves, _ = self._move_and_message(actions["agents"], moves=True, speaks=False)
        return moves, None

    def _relative(self) -> tuple[Tensor, Tensor, Tensor]:
        """The agents' positions ``[N, 2, E]``, the landmarks relative to each agent ``[N, L,
        2, E]`` and the other agents relative to each ``[N, N-1, 2, E]`` as new tensors, for a
        compiled graph. Eagerly they are written into a scratch buffer's views (no temporaries);
        in a graph those views would be inputs that alias each other and are written, which
        torch handles by rebuilding them around every call (at JaxMARL's Spread settings a
        single-step rollout block ran 1.14x faster without them; the values are the same).
        """
        s = self._state
        n, e = self.world.num_agents, self.num_envs
        pos = s["agent_pos"].transpose(0, 1)
        lm_rel = s["landmark_pos"].transpose(0, 1).unsqueeze(0) - pos.unsqueeze(1)
        others = pos.index_select(0, self._others).view(n, n - 1, 2, e)
        return pos, lm_rel, others - pos.unsqueeze(1)

    def _observe(self) -> tuple[dict[str, Tensor], Tensor]:
        s = self._state
        n, e = self.world.num_agents, self.num_envs
        if torch.compiler.is_compiling():
            pos, lm_rel, other_rel = self._relative()
            m = self.world.num_landmarks
            # (the other agents' messages: silent agents, zeros)
            silent = pos.new_zeros(n, self.obs_dim - 4 - 2 * m - 2 * (n - 1), e)
            rel = [lm_rel.flatten(1, 2), other_rel.flatten(1, 2)]
            parts = [s["agent_vel"].transpose(0, 1), pos, *rel, silent]
            state = torch.cat(parts, 1).view(n * self.obs_dim, e).t().contiguous()
            return {"agents": state.view(e, n, self.obs_dim)}, state
        pos = s["agent_pos"].transpose(0, 1)  # [N, 2, E]
        self._buf[:, 0:2] = s["agent_vel"].transpose(0, 1)
        self._buf[:, 2:4] = pos
        landmarks = s["landmark_pos"].transpose(0, 1)  # [L, 2, E]
        sub_into(self._lm_rel, landmarks.unsqueeze(0), pos.unsqueeze(1))
        if n > 1:
            others = pos.index_select(0, self._others).view(n, n - 1, 2, e)
            sub_into(self._other_rel, others, pos.unsqueeze(1))
        state = self._buf.view(n * self.obs_dim, e).t().clone(memory_format=torch.contiguous_format)
        return {"agents": state.view(e, n, self.obs_dim)}, state

    def _reward_and_stats(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        # Uses the relative positions that _observe just wrote for the current state (computed
        # again inside a compiled graph, where the two subtractions fuse into other kernels).
        s = self._state
        n, e = self.world.num_agents, self.num_envs
        lm_rel, other_rel = self._lm_rel, self._other_rel
        if torch.compiler.is_compiling():
            _, lm_rel, other_rel = self._relative()
        lm_x, lm_y = lm_rel[:, :, 0], lm_rel[:, :, 1]
        # sqrt is monotonic: the min of squared distances, then one sqrt per landmark.
        min_dist = torch.addcmul(lm_x * lm_x, lm_y, lm_y).amin(0).sqrt_()  # [L, E]
        sum_min_dist = min_dist.sum(0)
        ag_x, ag_y = other_rel[:, :, 0], other_rel[:, :, 1]
        # [N, N-1, E]: ordered pairs of distinct agents closer than the sum of their sizes.
        touching = torch.addcmul(ag_x * ag_x, ag_y, ag_y) < self._collide_dist2
        if self.reward_convention == "paper":
            # Sum over agents of (-sum_min_dist - #{a colliding with i, a = i included}).
            ordered = touching.sum((0, 1), dtype=torch.float32)
            shared = sum_min_dist.mul(-n).sub_(ordered).sub_(n)
            reward = shared.unsqueeze(1).expand(e, n).contiguous()
        else:
            hits = touching.sum(1, dtype=torch.float32)  # [N, E]: -local reward
            reward = (
                hits.mul(-self.local_ratio)
                .sub_(sum_min_dist, alpha=1.0 - self.local_ratio)
                .t()
                .contiguous()
            )
            ordered = hits.sum(0)
        # Each unordered pair appears twice among the ordered pairs.
        collisions = torch.add(s["episode_collisions"], ordered, alpha=0.5)
        s["episode_collisions"] = collisions
        stats = {
            "occupied_landmarks": (min_dist < OCCUPIED_RADIUS).sum(0, dtype=torch.float32),
            "collisions": collisions,
            "sum_min_dist": sum_min_dist,
        }
        return {"agents": reward}, stats

    def _render_info(
        self, env_index: int
    ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], list[str]]:
        agent_colors = [(0.35, 0.35, 0.85)] * self.world.num_agents
        landmark_colors = [(0.25, 0.25, 0.25)] * self.world.num_landmarks
        step = int(self._state["step"][env_index])
        return agent_colors, landmark_colors, [f"step {step}/{self.episode_length}"]
