"""Google Research Football through the worker-process adapter (``mappo.envs.football``).

The contract on the paper's first academy scenario (specs, auto-reset with the final observation,
terminations vs GRF's time limit as a truncation, seeding, faults in a worker, rendering), and a
short training run that trains, evaluates, renders and resumes from the command line. GRF is a
C++ game built from source (docs/football.md); CI builds it, and there a missing build fails
these tests instead of skipping them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from mappo.cli import main
from mappo.envs import EnvError, make
from mappo.envs.adapters import EnvWorkerError

if importlib.util.find_spec("gfootball") is None:
    if os.environ.get("CI"):
        raise RuntimeError("gfootball is not installed: .ci/run builds it (docs/football.md)")
    pytest.skip(
        "Google Research Football is not installed (docs/football.md)", allow_module_level=True
    )

from mappo.envs.football.grf import ACTIVE, OBS_DIM  # noqa: E402

SCENARIO = "football/academy_3_vs_1_with_keeper"
BALL = slice(88, 91)
"""The ball's position inside a simple115v2 vector; the scenario starts it at (0.62, 0)."""


def random_actions(num_envs: int, agents: int, generator: torch.Generator) -> dict:
    return {"player": torch.randint(0, 19, (num_envs, agents, 1), generator=generator)}


def play(env, steps: int, seed: int) -> tuple[list[np.ndarray], list]:
    """Observations and step results of ``steps`` random joint actions after ``reset(seed)``."""
    g = torch.Generator().manual_seed(seed)
    out = env.reset(seed=seed)
    trace, results = [out.obs["player"].numpy().copy()], []
    for _ in range(steps):
        out = env.step(random_actions(env.num_envs, 3, g))
        trace.append(out.obs["player"].numpy().copy())
        results.append(out)
    return trace, results


@pytest.fixture(scope="module")
def env():
    with make(SCENARIO, num_envs=4, num_workers=2) as e:
        yield e


def test_spec_and_first_observation(env) -> None:
    spec = env.spec
    (group,) = spec.groups.values()
    assert list(spec.groups) == ["player"]
    assert group.agents == ("player_0", "player_1", "player_2")
    assert group.obs_shape == (OBS_DIM,) and group.action.nvec == (19,)
    assert not group.has_action_mask
    assert spec.state_shape == (OBS_DIM,)
    assert spec.episode_limit == 401  # GRF's steps_left at the kick-off of a 400-step scenario
    assert spec.stat_names == ("episode_return", "episode_length", "success", "goal_difference")
    out = env.reset(seed=0)
    obs = out.obs["player"].numpy()
    assert obs.shape == (4, 3, OBS_DIM)
    np.testing.assert_allclose(obs[:, :, BALL][..., :2], [[[0.62, 0.0]] * 3] * 4, atol=1e-3)
    # Each agent controls a different player (one-hot), and the state is the pitch without it.
    active = obs[:, :, ACTIVE]
    assert (active.sum(-1) == 1).all() and (active.argmax(-1) != active[:, :1].argmax(-1)).any()
    expected = obs[:, 0].copy()
    expected[:, ACTIVE] = 0
    np.testing.assert_array_equal(out.state.numpy(), expected)
    assert out.alive["player"].all()


def test_auto_reset_keeps_the_final_observation(env) -> None:
    trace, results = play(env, 120, seed=1)
    ended = 0
    for t, out in enumerate(results):
        done = (out.terminated | out.truncated).numpy()
        for i in np.flatnonzero(done):
            ended += 1
            # The academy episode ended on a goal, a lost ball or the ball out of play.
            assert out.terminated[i] and not out.truncated[i]
            final = out.final_obs["player"][i].numpy()
            new = trace[t + 1][i]
            np.testing.assert_allclose(new[:, BALL][:, :2], [[0.62, 0.0]] * 3, atol=1e-3)
            assert not np.allclose(final, new)
            success, goals = out.stats["success"][i].item(), out.stats["goal_difference"][i].item()
            assert success == float(goals > 0) and goals in (-1.0, 0.0, 1.0)
            assert 1 <= out.stats["episode_length"][i].item() <= 401
        # Copies that did not end carry the observation on.
        live = ~done
        np.testing.assert_array_equal(out.final_obs["player"].numpy()[live], trace[t + 1][live])
    assert ended >= 2


def test_the_time_limit_is_a_truncation() -> None:
    # Standing still in academy_run_to_score never ends the episode before GRF's clock does.
    with make("football:academy_run_to_score", num_envs=1, num_agents=1, num_workers=0) as env:
        assert env.spec.episode_limit == 401
        env.reset(seed=0)
        idle = {"player": torch.zeros(1, 1, 1, dtype=torch.int64)}
        for _ in range(400):
            out = env.step(idle)
            assert not out.done.any()
        out = env.step(idle)
        assert out.truncated.item() and not out.terminated.item()
        assert out.stats["episode_length"].item() == 401 and out.stats["success"].item() == 0


def test_a_goal_is_a_success_with_the_team_reward() -> None:
    from mappo.envs.football.grf import FootballParallelEnv

    # academy_empty_goal_close: one player with the ball in front of an empty goal; shooting
    # (action 12) scores within a few steps.
    game = FootballParallelEnv("academy_empty_goal_close", num_agents=1)
    game.reset(seed=0)
    for _ in range(30):
        _, reward, terminated, truncated, infos = game.step({"player_0": 12})
        if not game.agents:
            break
    assert terminated["player_0"] and not truncated["player_0"]
    assert infos["player_0"] == {"goal_difference": 1.0, "success": 1.0}
    # +1 for the goal and +1.0 for the ten checkpoint rings, all collected on scoring.
    assert reward["player_0"] == pytest.approx(2.0)
    game.close()


def test_share_reward_sums_the_team_or_keeps_each_agent_its_own() -> None:
    from mappo.envs.football.grf import FootballParallelEnv

    own = FootballParallelEnv(num_agents=3, share_reward=False)
    shared = FootballParallelEnv(num_agents=3)
    rng = np.random.default_rng(0)
    own.reset(seed=4)
    shared.reset(seed=4)
    differed = False
    for _ in range(200):
        actions = {a: int(rng.integers(19)) for a in own.possible_agents}
        _, r_own, *_ = own.step(actions)
        _, r_shared, *_ = shared.step(actions)
        total = sum(r_own.values())
        assert all(v == pytest.approx(total) for v in r_shared.values())
        differed |= len(set(r_own.values())) > 1
        if not own.agents:
            assert not shared.agents
            own.reset()
            shared.reset()
    # Only the player carrying the ball into a checkpoint ring is rewarded for it.
    assert differed
    own.close()
    shared.close()


def test_the_full_game_replays_its_kick_off_from_the_seed() -> None:
    from mappo.envs.football.grf import FootballParallelEnv

    # The 11-vs-11 scenarios choose the kick-off team by the parity of GRF's episode counter.
    game = FootballParallelEnv("11_vs_11_easy_stochastic", num_agents=2)
    traces = []
    for _ in range(2):
        obs, _ = game.reset(seed=5)
        rng = np.random.default_rng(0)
        trace = [obs["player_0"]]
        for _ in range(20):
            obs, *_ = game.step({a: int(rng.integers(19)) for a in game.possible_agents})
            trace.append(obs["player_0"])
        traces.append(np.stack(trace))
    np.testing.assert_array_equal(traces[0], traces[1])
    game.close()


def test_the_same_seed_replays_in_any_worker_layout(env) -> None:
    first, _ = play(env, 40, seed=7)
    again, _ = play(env, 40, seed=7)
    other, _ = play(env, 40, seed=8)
    with make(SCENARIO, num_envs=4, num_workers=0) as in_process:
        layout, _ = play(in_process, 40, seed=7)
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    np.testing.assert_array_equal(np.stack(first), np.stack(layout))
    assert not np.array_equal(np.stack(first), np.stack(other))


def test_render_draws_the_pitch(env) -> None:
    env.reset(seed=0)
    frame = env.render(2)
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[1:] == (480, 3)
    colours = {tuple(c) for c in frame.reshape(-1, 3)[::7]}
    assert (60, 110, 230) in colours and (220, 60, 60) in colours  # both teams are drawn


def test_a_killed_worker_is_reported() -> None:
    env = make(SCENARIO, num_envs=2, num_workers=2)
    env.reset(seed=0)
    os.kill(env.worker_pids[1], signal.SIGKILL)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(EnvWorkerError, match=r"worker 1 .* was killed by SIGKILL"):
        for _ in range(5):
            env.step(random_actions(2, 3, g))
    with pytest.raises(EnvError, match="closed after an error"):
        env.step(random_actions(2, 3, g))


def test_bad_football_input_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    assert main(["train", SCENARIO, "env.kwargs={num_agents: 12}", "progress=false"]) == 2
    assert "num_agents must be an integer in 1..11, got 12" in capsys.readouterr().err
    # The 3-vs-1 scenario's left team has 4 players (the keeper too).
    assert main(["train", SCENARIO, "env.kwargs={num_agents: 5}", "progress=false"]) == 2
    err = capsys.readouterr().err
    assert "num_agents=5 is more than the left team's players in academy_3_vs_1" in err
    assert err.count("\n") == 1
    gif = tmp_path / "y.gif"
    assert main(["render", "football:academy_nothing", "num_agents=1", "--gif", str(gif)]) == 2
    assert "GRF has no scenario 'academy_nothing'" in capsys.readouterr().err
    gif = tmp_path / "x.gif"
    assert main(["render", "football:academy_empty_goal", "--gif", str(gif)]) == 2
    assert "set num_agents=<players the agents control>" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gfootball" else real(name, *a),
    )
    assert main(["train", SCENARIO, "progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs/football.md" in err
    # (a wheel has neither the docs nor the script: the message has the commands itself)
    assert "pip install --no-build-isolation --no-deps gfootball==2.10.2" in err


def test_a_run_whose_games_do_not_fit_in_memory_is_refused(tmp_path: Path, capsys, monkeypatch):
    # The preset's 50 training and 100 evaluation games take about 9 GB; say 4 GB are free.
    monkeypatch.setattr("mappo.trainer.available_bytes", lambda device: 4 * 2**30)
    assert main(["train", SCENARIO, "progress=false", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "needs about 8.8 GB of memory" in err and "lower eval_episodes" in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_train_evaluate_render_and_resume(tmp_path: Path, capsys) -> None:
    tiny = [
        "env.num_envs=2",
        "env.kwargs={num_workers: 2}",
        "rollout_length=20",
        "total_env_steps=80",
        "algo.epochs=2",
        "eval_episodes=1",
        "eval_interval=1",
        "log_interval=1",
        "checkpoint_interval=1",
        "threads=1",
        "progress=false",
        "tensorboard=false",
        f"run_dir={tmp_path}",
    ]
    assert main(["train", SCENARIO, *tiny]) == 0
    (run,) = list(tmp_path.glob("football/academy_3_vs_1_with_keeper/rmappo/*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] == 80 and "eval_success" in summary
    capsys.readouterr()
    gif = tmp_path / "play.gif"
    # One episode, and the one-game GIF, with the run's two workers cut to the one game.
    assert main(["eval", str(run), "--episodes", "1", "--gif", str(gif), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_episodes"] == 1 and result["eval_success"] in (0.0, 1.0)
    assert gif.stat().st_size > 1000
    assert main(["train", "--resume", str(run), "total_env_steps=160"]) == 0
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 160
