"""Replay the trajectories recorded from the MAPPO paper's own MPE code.

Every ``.npz`` in the fixture folder (``tests/fixtures/mappo_mpe`` or ``$MAPPO_MPE_FIXTURES``) is
one case: the start state is injected with ``set_state``, the recorded actions are replayed, and
every observation and reward must match to 1e-4 (the recording is float64, the env float32).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mappo.envs import BatchedEnv, make

FIXTURES = Path(
    os.environ.get("MAPPO_MPE_FIXTURES", Path(__file__).parent / "fixtures" / "mappo_mpe")
)
FILES = sorted(FIXTURES.glob("*.npz"))
TOL = 1e-4


def _scenario(path: Path) -> str:
    for name in ("simple_spread", "simple_speaker_listener", "simple_reference"):
        if path.name.startswith(name):
            return name
    raise ValueError(f"cannot tell the scenario of fixture {path.name}")


def _env_and_layout(path: Path, data: dict[str, np.ndarray]) -> tuple[BatchedEnv, list]:
    """The env for a fixture and ``[(group, [recorded agent index per group agent])]``."""
    scenario = _scenario(path)
    if scenario == "simple_spread":
        n, m = data["agent_pos0"].shape[0], data["landmark_pos0"].shape[0]
        env = make("mpe/simple_spread", num_agents=n, num_landmarks=m)
        return env, [("agents", list(range(n)))]
    if scenario == "simple_speaker_listener":
        return make("mpe/simple_speaker_listener"), [("speaker", [0]), ("listener", [1])]
    return make("mpe/simple_reference"), [("agents", [0, 1])]


def _start_state(path: Path, data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    state = {
        "agent_pos": torch.tensor(data["agent_pos0"])[None],
        "agent_vel": torch.tensor(data["agent_vel0"])[None],
        "agent_comm": torch.tensor(data["agent_comm0"])[None],
        "landmark_pos": torch.tensor(data["landmark_pos0"])[None],
        "step": torch.zeros(1, dtype=torch.int64),
    }
    goal = torch.tensor(data["goal_landmark"])
    if _scenario(path) == "simple_speaker_listener":
        state["goal_landmark"] = goal[:1]  # the speaker's goal; the listener has none (-1)
    elif _scenario(path) == "simple_reference":
        state["goal_landmark"] = goal[None]
    return state


def test_fixture_folder_is_not_empty() -> None:
    assert FILES, f"no .npz fixtures found in {FIXTURES}"


@pytest.mark.parametrize("path", FILES, ids=[f"fixture-{p.stem}" for p in FILES])
def test_fixture_replay(path: Path) -> None:
    data = dict(np.load(path))
    env, layout = _env_and_layout(path, data)
    steps = data["actions"].shape[0]
    assert env.spec.episode_limit == steps

    def check_obs(obs: dict[str, torch.Tensor], row: int) -> None:
        for group, agents in layout:
            for k, i in enumerate(agents):
                expected = data[f"obs_agent{i}"][row]
                got = obs[group][0, k].double().numpy()
                assert got.shape == expected.shape, (group, got.shape, expected.shape)
                np.testing.assert_allclose(got, expected, atol=TOL, err_msg=f"obs {i} row {row}")

    check_obs(env.set_state(_start_state(path, data)).obs, 0)
    for t in range(steps):
        actions = {}
        for group, agents in layout:
            heads = env.spec.groups[group].action.num_heads
            actions[group] = torch.tensor(data["actions"][t, agents, :heads])[None]
        out = env.step(actions)
        # final_obs is the observation the step reached, before any auto-reset.
        check_obs(out.final_obs, t + 1)
        for group, agents in layout:
            np.testing.assert_allclose(
                out.reward[group][0].double().numpy(),
                data["rewards"][t, agents],
                atol=TOL,
                err_msg=f"rewards step {t}",
            )
        assert bool(out.truncated[0]) == bool(data["dones"][t].all())
        assert not bool(out.terminated[0])
