"""``simple_speaker_listener``, the MAPPO paper's "Comm": a speaker tells a listener where to go.

The speaker (agent 0) cannot move; it sees the colour of the goal landmark and sends one of 3
messages. The listener (agent 1) cannot speak; it sees its velocity, the landmarks relative to
itself and the speaker's message of the same step, and moves. Agents have size 0.075, landmarks
0.04; nothing collides. Reset order as in the paper's MPE: the goal landmark is drawn first, then
agent positions and landmark positions, all uniform in ``[-1, 1]^2``.

Both agents' own reward is ``-|p_listener - p_goal|^2``; the collaborative world gives each agent
the sum over the two agents, i.e. twice that.

Episode statistics, reported every step and read at the step that ends the episode:
``goal_distance`` (listener to goal landmark at that step) and ``goal_reached`` (1 when that
distance is below 0.1, the radius at which Spread counts a landmark as occupied).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.base import ActionSpec, EnvSpec, GroupSpec
from mappo.envs.mpe.core import ParticleEnv, StateField, WorldSpec
from mappo.envs.mpe.params import check_int

LANDMARK_COLORS = ((0.65, 0.15, 0.15), (0.15, 0.65, 0.15), (0.15, 0.15, 0.65))
GOAL_RADIUS = 0.1
"""The goal counts as reached when the listener is closer than this."""


class SimpleSpeakerListener(ParticleEnv):
    """Batched ``simple_speaker_listener``: groups ``speaker`` (``speaker_0``, observation 3,
    ``Discrete(3)`` message) and ``listener`` (``listener_0``, observation 11, ``Discrete(5)``
    move). Global state: ``[speaker obs, listener obs]`` (14 floats)."""

    name = "mpe/simple_speaker_listener"

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        episode_length: int = 25,
    ) -> None:
        limit = check_int(self.name, "episode_length", episode_length, low=1)
        super().__init__(num_envs, device, seed)
        m, dim_c = len(LANDMARK_COLORS), 3
        self.spec = EnvSpec(
            groups={
                "speaker": GroupSpec(("speaker_0",), (3,), ActionSpec((dim_c,))),
                "listener": GroupSpec(("listener_0",), (2 + 2 * m + dim_c,), ActionSpec((5,))),
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
        goal = torch.randint(
            0,
            self.world.num_landmarks,
            (self.num_envs,),
            device=self.device,
            generator=self.generator,
        )
        return {"goal_landmark": goal}

    def _split_actions(self, actions: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
        return actions["listener"][..., 0], actions["speaker"][..., 0]

    def _observe(self) -> tuple[dict[str, Tensor], Tensor]:
        s = self._state
        buf = self._buf
        buf[0:3] = self._colors.index_select(1, s["goal_landmark"])
        buf[3:5] = s["agent_vel"][:, 1]
        listener = s["agent_pos"][:, 1]  # [2, E]
        torch.sub(s["landmark_pos"].transpose(0, 1), listener.unsqueeze(0), out=self._lm_rel)
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
        to_goal = self._lm_rel.gather(0, goal)[0]  # [2, E]
        dist2 = to_goal[0].square() + to_goal[1].square()
        shared = dist2.mul(-2.0).unsqueeze(1)
        dist = dist2.sqrt()
        stats = {"goal_distance": dist, "goal_reached": (dist < GOAL_RADIUS).to(torch.float32)}
        return {"speaker": shared, "listener": shared.clone()}, stats

    def _render_info(
        self, env_index: int
    ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], list[str]]:
        goal = int(self._state["goal_landmark"][env_index])
        # As the reference renderer: grey speaker, listener in its goal's colour lightened.
        listener = tuple(min(1.0, c + 0.45) for c in LANDMARK_COLORS[goal])
        comm = self._state["agent_comm"][:, 0, env_index]
        said = str(int(comm.argmax())) if bool(comm.any()) else "-"
        lines = [f"speaker_0 says {said}", f"goal: landmark {goal}"]
        return [(0.25, 0.25, 0.25), listener], list(LANDMARK_COLORS), lines
