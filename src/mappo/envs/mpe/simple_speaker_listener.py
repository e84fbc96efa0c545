"""``simple_speaker_listener``, the MAPPO paper's "Comm": a speaker tells a listener where to go.

The speaker (agent 0) cannot move; it sees the colour of the goal landmark and sends one of 3
messages. The listener (agent 1) cannot speak; it sees its velocity, the landmarks relative to
itself and the speaker's message of the same step, and moves. Agents have size 0.075, landmarks
0.04; nothing collides. Reset order as in the paper's MPE: the goal landmark is drawn first, then
agent positions and landmark positions, all uniform in ``[-1, 1]^2``.

Both agents' own reward is ``-|p_listener - p_goal|^2``. With ``reward="paper"`` (default) the
collaborative world gives each agent the sum over the two agents, i.e. twice that; with
``reward="pettingzoo"`` each agent gets its own reward, as mpe2's ``simple_speaker_listener_v4``
(which sets no ``local_ratio`` and does not sum).

Actions: the speaker's ``Discrete(3)`` message and the listener's ``Discrete(5)`` move (the
paper's signs: 1 +x, 2 -x, 3 +y, 4 -y), or with ``continuous_actions=True`` mpe2's boxes, float32
in ``[0, 1]``: the speaker ``Box(0, 1, (3,))`` (``[E, 1, 3]``), its message, which becomes its
communication state as it is, so the listener observes these 3 numbers instead of a one-hot; the
listener ``Box(0, 1, (5,))`` (``[E, 1, 5]``), components ``[no-op, -x, +x, -y, +y]`` with the
force ``5 * (a[2] - a[1], a[4] - a[3])`` in world units (``a[0]`` has no effect; mpe2's
``SimpleEnv._set_action``). ``physics="pettingzoo"`` integrates in mpe2's order (see
:mod:`mappo.envs.mpe.core`); with it, ``reward="pettingzoo"`` and continuous actions the env
matches ``mpe2.simple_speaker_listener_v4.env(continuous_actions=True)`` step for step from the
same state.

Episode statistics, reported every step and read at the step that ends the episode:
``goal_distance`` (listener to goal landmark at that step) and ``goal_reached`` (1 when that
distance is below 0.1, the radius at which Spread counts a landmark as occupied).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.base import EnvSpec, GroupSpec
from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec, sub_into
from mappo.envs.mpe.params import check_choice, check_int

LANDMARK_COLORS = ((0.65, 0.15, 0.15), (0.15, 0.65, 0.15), (0.15, 0.15, 0.65))
GOAL_RADIUS = 0.1
"""The goal counts as reached when the listener is closer than this."""
REWARD_CONVENTIONS = ("paper", "pettingzoo")


class SimpleSpeakerListener(ParticleEnv):
    """Batched ``simple_speaker_listener``: groups ``speaker`` (``speaker_0``, observation 3,
    ``Discrete(3)`` message or a box ``[0, 1]^3``) and ``listener`` (``listener_0``, observation
    11, ``Discrete(5)`` move or a box ``[0, 1]^5``; boxes with ``continuous_actions``, see the
    module docstring). Global state: ``[speaker obs, listener obs]`` (14 floats)."""

    name = "mpe/simple_speaker_listener"

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        episode_length: int = 25,
        reward: str = "paper",
        continuous_actions: bool = False,
        physics: str = "paper",
        time_feature: bool = False,
    ) -> None:
        """``reward``, ``continuous_actions`` and ``physics`` as in the module docstring;
        ``time_feature`` as in :mod:`mappo.envs.mpe.core`."""
        limit = check_int(self.name, "episode_length", episode_length, low=1)
        self.reward_convention = check_choice(self.name, "reward", reward, REWARD_CONVENTIONS)
        super().__init__(
            num_envs,
            device,
            seed,
            continuous_actions=continuous_actions,
            physics=physics,
            time_feature=time_feature,
        )
        m, dim_c = len(LANDMARK_COLORS), 3
        speaker = self._action_spec(moves=False, dim_c=dim_c)
        listener = self._action_spec(moves=True, dim_c=0)
        self.spec = EnvSpec(
            groups={
                "speaker": GroupSpec(("speaker_0",), (3,), speaker),
                "listener": GroupSpec(("listener_0",), (2 + 2 * m + dim_c,), listener),
            },
            state_shape=(3 + 2 + 2 * m + dim_c,),
            episode_limit=limit,
            stat_names=("goal_distance", "goal_reached"),
        )
        world = WorldSpec(
            agent_size=(0.075, 0.075),
            agent_movable=(False, True),
            agent_collide=(False, False),
            agent_silent=(False, True),
            landmark_size=(0.04,) * m,
            landmark_collide=(False,) * m,
            dim_c=dim_c,
        )
        # [3 (rgb), L]: column l is landmark l's colour.
        self._colors = torch.tensor(LANDMARK_COLORS, device=self.device).t().contiguous()
        # Feature-major state scratch [14, E]: speaker obs (goal colour), then listener obs
        # (velocity, landmarks relative to the listener, the speaker's message).
        self._buf = torch.zeros(self.spec.state_shape[0], num_envs, device=self.device)
        self._lm_rel = self._buf[5 : 5 + 2 * m].view(m, 2, num_envs)
        self._heard = self._buf[5 + 2 * m :]
        self._init_world(world, limit)

    def _extra_fields(self) -> dict[str, StateField]:
        return {"goal_landmark": StateField((), torch.int64, 0, self.world.num_landmarks)}

    def _sample_extras(self) -> dict[str, Tensor]:
        return {"goal_landmark": self._randint(self.world.num_landmarks)}

    def _split_actions(self, actions: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
        moves, _ = self._move_and_message(actions["listener"], moves=True, speaks=False)
        _, messages = self._move_and_message(actions["speaker"], moves=False, speaks=True)
        return moves, messages

    def _lm_relative(self) -> Tensor:
        """The landmarks relative to the listener ``[L, 2, E]`` as a new tensor, for a compiled
        graph (SimpleSpread._relative: views written inside a graph are rebuilt around every
        call of it)."""
        s = self._state
        return s["landmark_pos"].transpose(0, 1) - s["agent_pos"][:, 1].unsqueeze(0)

    def _observe(self) -> tuple[dict[str, Tensor], Tensor]:
        s = self._state
        color = self._colors.index_select(1, s["goal_landmark"])
        if torch.compiler.is_compiling():
            parts = [color, s["agent_vel"][:, 1], self._lm_relative().flatten(0, 1)]
            state = torch.cat([*parts, s["agent_comm"][:, 0]]).t().contiguous()
        else:
            buf = self._buf
            buf[0:3] = color
            buf[3:5] = s["agent_vel"][:, 1]
            listener = s["agent_pos"][:, 1]  # [2, E]
            sub_into(self._lm_rel, s["landmark_pos"].transpose(0, 1), listener.unsqueeze(0))
            self._heard.copy_(s["agent_comm"][:, 0])
            state = buf.t().clone(memory_format=torch.contiguous_format)
        obs = {
            "speaker": state[:, 0:3].unsqueeze(1).contiguous(),
            "listener": state[:, 3:].unsqueeze(1).contiguous(),
        }
        return obs, state

    def _reward_and_stats(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        # Uses the listener-to-landmark vectors that _observe just wrote: [L, 2, E] -> goal's.
        goal = self._state["goal_landmark"].view(1, 1, -1).expand(1, 2, -1)
        lm_rel = self._lm_relative() if torch.compiler.is_compiling() else self._lm_rel
        to_goal = lm_rel.gather(0, goal)[0]  # [2, E]
        dist2 = to_goal[0].square() + to_goal[1].square()
        # The paper sums the two agents' equal rewards; mpe2 gives each its own.
        scale = -2.0 if self.reward_convention == "paper" else -1.0
        reward = dist2.mul(scale).unsqueeze(1)
        dist = dist2.sqrt()
        stats = {"goal_distance": dist, "goal_reached": (dist < GOAL_RADIUS).to(torch.float32)}
        return {"speaker": reward, "listener": reward.clone()}, stats

    def _render_info(
        self, env_index: int
    ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], list[str]]:
        goal = int(self._state["goal_landmark"][env_index])
        # As the reference renderer: grey speaker, listener in its goal's colour lightened.
        listener = tuple(min(1.0, c + 0.45) for c in LANDMARK_COLORS[goal])
        lines = [f"speaker_0 says {self._said(0, env_index)}", f"goal: landmark {goal}"]
        return [(0.25, 0.25, 0.25), listener], list(LANDMARK_COLORS), lines
