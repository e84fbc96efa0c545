"""PettingZooView: one copy of a batched env as a PettingZoo ParallelEnv; and the examples of
docs/environments.md, which must keep running."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces
from pettingzoo.test import parallel_api_test

from mappo.envs import ActionError, EnvError, make
from mappo.envs.pettingzoo_view import PettingZooView

NAMES = ("mpe/simple_spread", "mpe/simple_speaker_listener", "mpe/simple_reference")
DOCS = Path(__file__).parent.parent / "docs" / "environments.md"


@pytest.mark.parametrize("name", NAMES)
def test_parallel_api(name: str) -> None:
    parallel_api_test(PettingZooView(name, seed=1), num_cycles=60)


def test_spaces_and_agents() -> None:
    view = PettingZooView("mpe/simple_speaker_listener")
    assert view.possible_agents == ["speaker_0", "listener_0"]
    assert view.observation_space("speaker_0").shape == (3,)
    assert view.observation_space("listener_0").shape == (11,)
    assert view.action_space("speaker_0") == spaces.Discrete(3)
    assert view.action_space("listener_0") == spaces.Discrete(5)
    ref = PettingZooView("mpe/simple_reference")
    assert ref.action_space("agent_1") == spaces.MultiDiscrete([5, 10])
    assert ref.state_space.shape == (42,)


def test_matches_the_batched_env_and_ends_after_the_time_limit() -> None:
    batched = make("mpe/simple_reference", num_envs=1, seed=3)
    view = PettingZooView(make("mpe/simple_reference", num_envs=1, seed=3))
    ref = batched.reset(seed=4)
    obs, infos = view.reset(seed=4)
    np.testing.assert_array_equal(obs["agent_1"], ref.obs["agents"][0, 1].numpy())
    np.testing.assert_array_equal(view.state(), ref.state[0].numpy())
    rng = np.random.default_rng(0)
    for t in range(25):
        move, msg = rng.integers(0, 5, 2), rng.integers(0, 10, 2)
        actions = {"agent_0": np.array([move[0], msg[0]]), "agent_1": np.array([move[1], msg[1]])}
        ref = batched.step({"agents": torch.tensor([[[move[0], msg[0]], [move[1], msg[1]]]])})
        obs, rewards, terminations, truncations, infos = view.step(actions)
        # The view returns the observation the step reached (pre-reset) as float32.
        assert obs["agent_0"].dtype == np.float32
        np.testing.assert_array_equal(obs["agent_0"], ref.final_obs["agents"][0, 0].numpy())
        np.testing.assert_array_equal(view.state(), ref.final_state[0].numpy())
        assert rewards["agent_1"] == pytest.approx(float(ref.reward["agents"][0, 1]))
        assert not any(terminations.values())
        assert all(truncations.values()) == (t == 24)
    assert view.agents == []
    assert set(infos["agent_0"]["stats"]) == {"goal_distance", "goals_reached"}
    frame = view.render()
    assert frame.shape == (400, 400, 3) and frame.dtype == np.uint8
    with pytest.raises(EnvError, match="call reset"):
        view.step({"agent_0": np.array([0, 0]), "agent_1": np.array([0, 0])})


def test_bad_uses_raise() -> None:
    with pytest.raises(EnvError, match="num_envs=1"):
        PettingZooView(make("mpe/simple_spread", num_envs=2))
    with pytest.raises(EnvError, match="unknown parameter"):
        PettingZooView("mpe/simple_spread", num_agent=2)
    view = PettingZooView("mpe/simple_spread", num_agents=2)
    assert view.possible_agents == ["agent_0", "agent_1"]
    view.reset()
    with pytest.raises(EnvError, match=r"missing \['agent_1'\]"):
        view.step({"agent_0": 1})
    with pytest.raises(ActionError, match="out of range"):
        view.step({"agent_0": 1, "agent_1": 7})


# -- the documentation's examples ------------------------------------------------------------
def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _doc_blocks()
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)  # the rendering example writes a GIF
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), {"__name__": "docs_example"})
    assert (tmp_path / "speaker_listener.gif").stat().st_size > 0


def test_docs_custom_env_meets_the_contract() -> None:
    namespace: dict = {"__name__": "docs_example"}
    custom = next(b for b in _doc_blocks() if "class GuessTheColor" in b)
    exec(compile(custom, str(DOCS), "exec"), namespace)
    env_cls = namespace["GuessTheColor"]
    # The PettingZoo API test samples actions from the action masks in the observations.
    parallel_api_test(PettingZooView(env_cls(num_envs=1, seed=0)), num_cycles=30)
    env = make("example/guess_the_color", num_envs=4, seed=0)
    step = env.reset()
    forbidden = step.action_mask["players"].float().argmin(-1, keepdim=True)
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step({"players": forbidden})
    with pytest.raises(ActionError, match="out of range"):
        env.step({"players": torch.full((4, 2, 1), 9)})
