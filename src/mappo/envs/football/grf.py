"""One Google Research Football game in the PettingZoo ``ParallelEnv`` protocol.

:class:`FootballParallelEnv` wraps ``gfootball.env.create_environment`` (Kurach et al. 2020,
"Google Research Football: A Novel Reinforcement Learning Environment", arXiv 1907.11180) the way
the MAPPO paper's code sets it up (Yu et al. 2022, Appendix, GRF): the left team's first ``n``
players are agents, each observing the ``simple115v2`` vector (115 floats: the positions and
directions of all 22 players, the ball's position, direction and owner, the one-hot of the player
the agent controls and of the game mode), acting with GRF's 19 default actions, and rewarded
with ``scoring,checkpoints`` (+1 for a goal, -1 for conceding; +0.1 for each of 10 distance
rings to the opponent's goal that the agent carries the ball into, all remaining rings on
scoring). As in the paper's code the agents' rewards are summed into one team reward that
every agent receives (``share_reward``).

The batched env is the worker-process adapter over copies of this class (see
:mod:`mappo.envs.football`); this module is what the workers import. It reads ``gfootball`` only
when a game is built, so it imports without it.

- **Global state**: the ``simple115v2`` vector with the controlled-player one-hot cleared: what
  every agent sees, which is the whole pitch. (The paper's code gives each agent's critic that
  agent's own observation; with one shared team reward the two carry the same information.)
- **Episodes** end on a goal, when the ball goes out or changes team (the academy scenarios), or
  when GRF's clock runs out (``game_duration`` + 1 steps: 401 in the academy, 3,001 in the full
  game); the last is a truncation (the observation has no clock), unless a goal ends the episode
  on that same step; the others are terminations.
- **Statistics** at an episode's end, in every agent's info: ``goal_difference`` (goals scored
  minus conceded) and ``success`` (1 when it is positive: the academy task was solved, or the
  match won).
- **Seeding**: GRF draws each episode's engine seed from Python's global ``random``; here each
  game draws it from its own ``random.Random`` seeded by ``reset(seed)``, so the same seeds give
  the same episodes in any worker layout.
- **Rendering** draws the pitch from above (players, ball, score) with Pillow, headless: GRF's own
  3D renderer needs an OpenGL display.
"""

from __future__ import annotations

import contextlib
import io
import random
from typing import Any

import numpy as np

OBS_DIM = 115
NUM_ACTIONS = 19
ACTIVE = slice(97, 108)
"""The controlled-player one-hot inside a ``simple115v2`` vector."""

PITCH_X, PITCH_Y = 1.0, 0.42
"""GRF's pitch: x in [-1, 1] (the left team attacks towards +1), y in [-0.42, 0.42]."""


class FootballParallelEnv:
    """One GRF game; agents ``player_0 .. player_{n-1}`` are the left team's controlled players.

    Args:
        scenario: a GRF scenario name (``academy_3_vs_1_with_keeper``, ``11_vs_11_stochastic``,
            ...; the files of ``gfootball/scenarios``).
        num_agents: how many left-team players the agents control (GRF hands control of the
            others to its built-in AI).
        rewards: GRF's reward names, ``"scoring"`` or ``"scoring,checkpoints"``.
        share_reward: every agent receives the sum of the agents' rewards (the paper's code);
            otherwise each its own.
        render_width: width of a rendered frame in pixels (the height follows the pitch).
    """

    metadata = {"name": "football", "render_modes": ["rgb_array"]}
    episode_stats = ("success", "goal_difference")

    def __init__(
        self,
        scenario: str = "academy_3_vs_1_with_keeper",
        num_agents: int = 3,
        rewards: str = "scoring,checkpoints",
        share_reward: bool = True,
        render_width: int = 480,
    ) -> None:
        try:
            # gym 0.23 prints a notice about its own age to stderr on import, in every worker.
            with contextlib.redirect_stderr(io.StringIO()):
                import gfootball.env as football_env
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] == "gfootball":
                from mappo.envs.football import BUILD_HINT

                raise ModuleNotFoundError(
                    f"Google Research Football is not installed; {BUILD_HINT}"
                ) from err
            raise ModuleNotFoundError(
                f"Google Research Football needs the Python module {err.name!r}: install the "
                "project's football extra (pip install 'mappo[football]', or -e '.[football]' "
                "from its source)"
            ) from err
        from gymnasium import spaces

        if not isinstance(num_agents, int) or num_agents < 1:
            raise ValueError(f"num_agents must be a positive integer, got {num_agents!r}")
        self.scenario = scenario
        self.share_reward = bool(share_reward)
        self.render_width = int(render_width)
        try:
            self.env = football_env.create_environment(
                env_name=scenario,
                representation="simple115v2",
                rewards=rewards,
                number_of_left_players_agent_controls=num_agents,
                number_of_right_players_agent_controls=0,
            )
        except IndexError as err:  # GRF, asked for more players than the team has
            raise ValueError(
                f"num_agents={num_agents} is more than the left team's players in {scenario} "
                f"(GRF: {err})"
            ) from None
        self.possible_agents = [f"player_{i}" for i in range(num_agents)]
        self.agents: list[str] = []
        self._obs_space = spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
        self._act_space = spaces.Discrete(NUM_ACTIONS)
        self._rng = random.Random()
        self._obs = np.zeros((num_agents, OBS_DIM), np.float32)
        self._goal_difference = 0
        # The adapter reads the episode limit from ``max_steps``; GRF counts it down in the raw
        # observation, so one reset tells it (and checks that the scenario builds).
        self._reset_game()
        self.max_steps = int(self._raw()[0]["steps_left"])

    # -- the ParallelEnv protocol -------------------------------------------------------------
    def observation_space(self, agent: str) -> Any:
        return self._obs_space

    def action_space(self, agent: str) -> Any:
        return self._act_space

    def reset(
        self, seed: int | None = None, options: dict | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        if seed is not None:
            self._rng.seed(seed)
            # GRF fixes the team-processing order from the first episode's engine seed, and the
            # full-game scenarios pick the kick-off team by the parity of an episode counter:
            # a seeded reset starts both afresh, so that the seed alone decides the episodes.
            values = self.env.unwrapped._config._values
            values.pop("reverse_team_processing", None)
            values["episode_number"] = 0
        self._reset_game()
        self.agents = list(self.possible_agents)
        return self._by_agent(self._obs), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        joint = [int(actions[a]) for a in self.possible_agents]
        obs, reward, done, info = self.env.step(joint)
        self._obs = np.asarray(obs, np.float32).reshape(len(self.possible_agents), OBS_DIM)
        reward = np.asarray(reward, np.float64).reshape(-1)
        if self.share_reward:
            reward = np.full(len(self.possible_agents), reward.sum())
        self._goal_difference += int(info["score_reward"])
        # GRF's clock running out is a truncation, unless a goal ended the episode on that step.
        truncated = bool(done) and self._raw()[0]["steps_left"] <= 0 and info["score_reward"] == 0
        terminated = bool(done) and not truncated
        infos: dict[str, dict] = {a: {} for a in self.possible_agents}
        if done:
            stats = {
                "goal_difference": float(self._goal_difference),
                "success": float(self._goal_difference > 0),
            }
            infos = {a: dict(stats) for a in self.possible_agents}
            self.agents = []
        agents = self.possible_agents
        return (
            self._by_agent(self._obs),
            {a: float(r) for a, r in zip(agents, reward, strict=True)},
            {a: terminated for a in agents},
            {a: truncated for a in agents},
            infos,
        )

    def state(self) -> np.ndarray:
        """``[115]``: the pitch as every agent sees it, without the controlled-player one-hot."""
        state = self._obs[0].copy()
        state[ACTIVE] = 0.0
        return state

    def render(self) -> np.ndarray:
        """``[H, W, 3]`` uint8: the pitch from above (see :func:`draw_pitch`)."""
        raw = self._raw()
        return draw_pitch(raw[0], [int(r["active"]) for r in raw], self.render_width)

    def close(self) -> None:
        self.env.close()

    # -- internals ----------------------------------------------------------------------------
    def _reset_game(self) -> None:
        # The engine seed GRF would draw from the global ``random``, drawn from this game's own.
        self.env.unwrapped._config._values["game_engine_random_seed"] = self._rng.randrange(2**31)
        obs = self.env.reset()
        self._obs = np.asarray(obs, np.float32).reshape(len(self.possible_agents), OBS_DIM)
        self._goal_difference = 0

    def _raw(self) -> list[dict[str, Any]]:
        """GRF's raw observation, one dict per controlled player."""
        return self.env.unwrapped.observation()

    def _by_agent(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        return {a: obs[i].copy() for i, a in enumerate(self.possible_agents)}


def draw_pitch(raw: dict[str, Any], controlled: list[int], width: int = 480) -> np.ndarray:
    """Draw one raw GRF observation from above: ``[H, W, 3]`` uint8.

    Left team blue (the players in ``controlled``, the agents' current players, ringed in
    yellow), right team red, the ball white (drawn larger the higher it flies), the score and the
    steps left at the top.
    """
    from PIL import Image, ImageDraw

    margin = max(4, width // 40)
    header = max(12, width // 28)
    scale = (width - 2 * margin) / (2 * PITCH_X)
    height = int(round(2 * PITCH_Y * scale)) + 2 * margin + header
    image = Image.new("RGB", (width, height), (40, 120, 50))
    draw = ImageDraw.Draw(image)

    def px(x: float, y: float) -> tuple[float, float]:
        return margin + (x + PITCH_X) * scale, header + margin + (y + PITCH_Y) * scale

    white = (235, 235, 235)
    line = max(1, width // 240)
    draw.rectangle([px(-PITCH_X, -PITCH_Y), px(PITCH_X, PITCH_Y)], outline=white, width=line)
    draw.line([px(0, -PITCH_Y), px(0, PITCH_Y)], fill=white, width=line)
    cx, cy = px(0, 0)
    r = 0.09 * scale
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=white, width=line)
    for side in (-1, 1):  # penalty areas and goals
        x0 = side * PITCH_X
        draw.rectangle(
            [px(min(x0, x0 - side * 0.3), -0.24), px(max(x0, x0 - side * 0.3), 0.24)],
            outline=white,
            width=line,
        )
        draw.rectangle(
            [px(min(x0, x0 + side * 0.02), -0.044), px(max(x0, x0 + side * 0.02), 0.044)],
            fill=white,
        )
    radius = max(3.0, 0.018 * scale)
    for team, color in (("left_team", (60, 110, 230)), ("right_team", (220, 60, 60))):
        for i, (x, y) in enumerate(np.asarray(raw[team], np.float64).reshape(-1, 2)):
            u, v = px(x, y)
            draw.ellipse([u - radius, v - radius, u + radius, v + radius], fill=color)
            if team == "left_team" and i in controlled:  # GRF's index of the player
                ring = radius + max(1.5, radius / 3)
                draw.ellipse([u - ring, v - ring, u + ring, v + ring], outline=(250, 220, 40))
    bx, by, bz = (float(c) for c in np.asarray(raw["ball"], np.float64)[:3])
    u, v = px(bx, by)
    b = radius * 0.6 * (1.0 + min(max(bz, 0.0), 3.0) / 3.0)
    draw.ellipse([u - b, v - b, u + b, v + b], fill=(255, 255, 255), outline=(0, 0, 0))
    score = np.asarray(raw.get("score", [0, 0]), int).tolist()
    text = f"{score[0]} - {score[1]}    steps left {int(raw.get('steps_left', 0))}"
    draw.text((margin, 2), text, fill=white)
    return np.asarray(image, dtype=np.uint8)
