"""Continuous actions of the particle environments, checked step for step against PettingZoo's
``mpe2`` with ``continuous_actions=True``.

mpe2's worlds differ from the paper's MPE (which the default envs follow, see
test_mpe_fixtures.py) in the integration order and in the rewards of Reference and Comm, so the
reference runs use ``physics="pettingzoo"`` and ``reward="pettingzoo"``. Every run starts from
mpe2's own reset state, injected with ``set_state``; then both envs take the same random actions
for a full episode, and observations and rewards must match to 1e-4 at every step. The episodes
of all seeds run side by side in one batched env (env ``k`` plays the episode of seed ``k``).

Seeds: ``MAPPO_MPE2_SEEDS`` (comma-separated integers, default ``0,1,2``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from mappo.envs import ActionError, BatchedEnv, EnvError, EnvStep, make

mpe2 = pytest.importorskip("mpe2")
from mpe2 import (  # noqa: E402
    simple_reference_v3,
    simple_speaker_listener_v4,
    simple_spread_v3,
)

TOL = 1e-4
STEPS = 25


def _seeds() -> list[int]:
    text = os.environ.get("MAPPO_MPE2_SEEDS", "0,1,2")
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as err:
        raise ValueError(f"MAPPO_MPE2_SEEDS must list integers like '0,1,2', got {text!r}") from err
    if not seeds:
        raise ValueError(f"MAPPO_MPE2_SEEDS lists no seed: {text!r}")
    return seeds


SEEDS = _seeds()


@dataclass(frozen=True)
class Case:
    """One scenario: our env, the mpe2 module and which mpe2 agent is which of our agents."""

    name: str
    kwargs: dict[str, Any]
    module: Any
    layout: tuple[tuple[str, tuple[str, ...]], ...]
    """``(group, mpe2 agent names in the group's order)`` for every group."""


PZ = {"continuous_actions": True, "physics": "pettingzoo", "reward": "pettingzoo"}
CASES = {
    "simple_spread": Case(
        "mpe/simple_spread",
        PZ,
        simple_spread_v3,
        (("agents", ("agent_0", "agent_1", "agent_2")),),
    ),
    "simple_reference": Case(
        "mpe/simple_reference",
        PZ,
        simple_reference_v3,
        (("agents", ("agent_0", "agent_1")),),
    ),
    "simple_speaker_listener": Case(
        "mpe/simple_speaker_listener",
        PZ,
        simple_speaker_listener_v4,
        (("speaker", ("speaker_0",)), ("listener", ("listener_0",))),
    ),
}


def _mpe2_state(scenario: str, world: Any) -> dict[str, torch.Tensor]:
    """mpe2's world state as one env's state fields, ``[1, ...]`` (our ``set_state`` layout)."""
    state = {
        "agent_pos": np.stack([a.state.p_pos for a in world.agents]),
        "agent_vel": np.stack([a.state.p_vel for a in world.agents]),
        "agent_comm": np.stack([a.state.c for a in world.agents]),
        "landmark_pos": np.stack([lm.state.p_pos for lm in world.landmarks]),
    }
    out = {k: torch.tensor(v, dtype=torch.float32)[None] for k, v in state.items()}
    out["step"] = torch.zeros(1, dtype=torch.int64)
    if scenario == "simple_reference":
        goals = [world.landmarks.index(a.goal_b) for a in world.agents]
        out["goal_landmark"] = torch.tensor([goals])
    elif scenario == "simple_speaker_listener":
        out["goal_landmark"] = torch.tensor([world.landmarks.index(world.agents[0].goal_b)])
    return out


def _episode_actions(env: BatchedEnv, seed: int) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` uniform actions ``[1, n, d]`` per group inside the boxes, from a generator
    seeded with the episode's seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        step = {}
        for group, spec in env.spec.groups.items():
            low = torch.tensor(spec.action.low)
            high = torch.tensor(spec.action.high)
            u = torch.rand(1, spec.num_agents, spec.action.num_heads, generator=gen)
            step[group] = low + u * (high - low)
        out.append(step)
    return out


def _compare(
    case: Case,
    seeds: list[int],
    ours: dict[str, torch.Tensor],
    theirs: list[dict[str, np.ndarray]],
    what: str,
    t: int,
) -> None:
    """``ours`` per group ``[E, n, ...]`` against one mpe2 dict per env, named by agent."""
    for group, agents in case.layout:
        for k, seed in enumerate(seeds):
            for i, agent in enumerate(agents):
                np.testing.assert_allclose(
                    ours[group][k, i].double().numpy(),
                    np.asarray(theirs[k][agent], dtype=np.float64),
                    atol=TOL,
                    rtol=0,
                    err_msg=f"{what} of {agent}, seed {seed}, step {t}",
                )


def _run_against_mpe2(
    scenario: str, seeds: list[int], start: Any = None
) -> tuple[BatchedEnv, list[EnvStep]]:
    """Play one episode per seed in mpe2 and, batched, in our env; check every step.

    ``start(world, seed)``, if given, edits each mpe2 world after its reset (before the state is
    injected), e.g. to crowd the agents."""
    case = CASES[scenario]
    refs = []
    obs0 = []
    states = []
    for seed in seeds:
        ref = case.module.parallel_env(continuous_actions=True, max_cycles=STEPS)
        obs, _ = ref.reset(seed=seed)
        world = ref.unwrapped.world
        if start is not None:
            start(world, seed)
            obs = {a: ref.unwrapped.observe(a) for a in ref.agents}
        refs.append(ref)
        obs0.append(obs)
        states.append(_mpe2_state(scenario, world))
    env = make(case.name, num_envs=len(seeds), seed=1234, **case.kwargs)
    batch = {key: torch.cat([s[key] for s in states]) for key in states[0]}
    first = env.set_state(batch)
    _compare(case, seeds, first.obs, obs0, "first observation", 0)
    plans = [_episode_actions(env, seed) for seed in seeds]
    outs = []
    for t in range(STEPS):
        actions = {
            group: torch.cat([plan[t][group] for plan in plans]) for group in env.spec.groups
        }
        out = env.step(actions)
        outs.append(out)
        obs, rew, trunc = [], [], []
        for k, ref in enumerate(refs):
            mine = {
                agent: actions[group][k, i].numpy()
                for group, agents in case.layout
                for i, agent in enumerate(agents)
            }
            o, r, _, tr, _ = ref.step(mine)
            obs.append(o)
            rew.append({a: np.float64(v) for a, v in r.items()})
            trunc.append(all(tr.values()))
        # final_obs is the observation the step reached, before our auto-reset at the limit.
        _compare(case, seeds, out.final_obs, obs, "observation", t + 1)
        _compare(case, seeds, out.reward, rew, "reward", t + 1)
        assert out.truncated.tolist() == trunc, t
        assert not out.terminated.any()
    for ref in refs:
        ref.close()
    return env, outs


# -- step for step against mpe2 ---------------------------------------------------------------
@pytest.mark.parametrize("scenario", list(CASES))
def test_mpe2_continuous_episodes_match(scenario: str) -> None:
    env, outs = _run_against_mpe2(scenario, SEEDS)
    assert outs[-1].truncated.all()


def test_mpe2_continuous_spread_with_contacts() -> None:
    """Two agents started overlapping and the third apart, so that contact forces and collision
    penalties act and the agents' rewards differ for any seed (a crowd of all three drawn at
    random did not always: with every agent in contact, every penalty is the same)."""

    def crowd(world: Any, seed: int) -> None:
        rng = np.random.default_rng(seed)
        near = rng.uniform(-0.1, 0.1, 2)
        starts = [near, near + rng.uniform(-0.05, 0.05, 2), rng.uniform(0.6, 0.9, 2)]
        for agent, pos in zip(world.agents, starts, strict=True):
            agent.state.p_pos = pos

    env, outs = _run_against_mpe2("simple_spread", SEEDS, start=crowd)
    # The local (collision) part of the reward made a difference at some step.
    rewards = torch.stack([o.reward["agents"] for o in outs])
    assert (rewards != rewards[..., :1]).any(), "the crowded start must produce collisions"


@pytest.mark.parametrize("scenario", list(CASES))
def test_mpe2_continuous_bounds_equal_mpe2_action_spaces(scenario: str) -> None:
    case = CASES[scenario]
    env = make(case.name, continuous_actions=True)
    ref = case.module.parallel_env(continuous_actions=True)
    for group, agents in case.layout:
        spec = env.spec.groups[group].action
        assert spec.continuous and spec.dtype == torch.float32
        for agent in agents:
            space = ref.action_space(agent)
            assert spec.num_heads == space.shape[0], agent
            assert spec.low == tuple(float(x) for x in space.low), agent
            assert spec.high == tuple(float(x) for x in space.high), agent
    ref.close()


# -- the action spaces -----------------------------------------------------------------------
def test_discrete_mode_is_unchanged() -> None:
    expected = {
        "mpe/simple_spread": {"agents": (5,)},
        "mpe/simple_reference": {"agents": (5, 10)},
        "mpe/simple_speaker_listener": {"speaker": (3,), "listener": (5,)},
    }
    for name, groups in expected.items():
        for env in (make(name), make(name, continuous_actions=False)):
            for group, nvec in groups.items():
                action = env.spec.groups[group].action
                assert action.nvec == nvec and not action.continuous, (name, group)
                assert action.low is None and action.dtype == torch.int64


def test_continuous_spread_by_name_and_kwarg() -> None:
    by_name = make("mpe/simple_spread_continuous", num_envs=4, num_agents=2)
    by_kwarg = make("mpe/simple_spread", num_envs=4, num_agents=2, continuous_actions=True)
    assert by_name.spec == by_kwarg.spec
    assert by_name.spec.groups["agents"].action.low == (0.0,) * 5
    with pytest.raises(EnvError, match="always has continuous actions"):
        make("mpe/simple_spread_continuous", continuous_actions=False)
    # An unknown parameter is named with the env the user gave, among the parameters it takes.
    with pytest.raises(EnvError) as info:
        make("mpe/simple_spread_continuous", n_agents=2)
    message = str(info.value)
    assert message.startswith("mpe/simple_spread_continuous: unknown parameter 'n_agents'")
    assert "num_agents" in message and "continuous_actions" not in message


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"continuous_actions": "yes"}, "continuous_actions must be true or false"),
        ({"continuous_actions": 1}, "continuous_actions must be true or false"),
        ({"physics": "mpe"}, r"physics must be one of \['paper', 'pettingzoo'\]"),
        ({"contiuous_actions": True}, "did you mean 'continuous_actions'"),
    ],
)
def test_bad_continuous_parameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(EnvError, match=match):
        make("mpe/simple_reference", **kwargs)


@pytest.mark.parametrize("name", [c.name for c in CASES.values()])
def test_out_of_bounds_or_nan_actions_raise(name: str) -> None:
    env = make(name, num_envs=2, continuous_actions=True)
    env.reset(seed=0)
    good = {
        g: torch.full((2, s.num_agents, s.action.num_heads), 0.5)
        for g, s in env.spec.groups.items()
    }
    env.step(good)
    group = next(iter(good))
    for value, match in ((1.5, "outside the box"), (-0.1, "outside the box"), (np.nan, "finite")):
        bad = {g: a.clone() for g, a in good.items()}
        bad[group][1, 0, -1] = value
        with pytest.raises(ActionError, match=match):
            env.step(bad)
    with pytest.raises(ActionError, match="dtype"):
        env.step({g: a.long() for g, a in good.items()})
    with pytest.raises(ActionError, match="shape"):
        env.step({g: a[..., :-1] for g, a in good.items()})


# -- continuous actions in the paper's physics -----------------------------------------------
# The paper's discrete move k pushes as mpe2's continuous component ONE_HOT[k] (opposite signs).
ONE_HOT = torch.tensor([0, 2, 1, 4, 3])


@pytest.mark.parametrize("name", [c.name for c in CASES.values()])
def test_one_hot_continuous_actions_replay_discrete_moves(name: str) -> None:
    """In the paper's physics, one-hot continuous actions give the trajectory of the discrete
    actions: the continuous path only changes how actions become forces and messages."""
    discrete = make(name, num_envs=3)
    continuous = make(name, num_envs=3, continuous_actions=True)
    discrete.reset(seed=4)
    continuous.set_state(discrete.get_state())
    # The episode after the auto-reset comes from the generator: both draw the same one.
    continuous.generator.set_state(discrete.generator.get_state())
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):  # crosses an auto-reset
        actions, boxes = {}, {}
        for group, spec in discrete.spec.groups.items():
            heads = [
                torch.randint(0, k, (3, spec.num_agents), generator=gen) for k in spec.action.nvec
            ]
            actions[group] = torch.stack(heads, -1)
            parts = []
            for j, (k, head) in enumerate(zip(spec.action.nvec, heads, strict=True)):
                # Every group's first head is its move, but for the speaker, which only speaks.
                move = j == 0 and group != "speaker"
                parts.append(torch.nn.functional.one_hot(ONE_HOT[head] if move else head, k))
            boxes[group] = torch.cat(parts, -1).float()
        a, b = discrete.step(actions), continuous.step(boxes)
        for group in a.obs:
            torch.testing.assert_close(b.final_obs[group], a.final_obs[group])
            torch.testing.assert_close(b.reward[group], a.reward[group])
        assert torch.equal(a.truncated, b.truncated)


def test_continuous_messages_are_the_comm_state() -> None:
    env = make("mpe/simple_reference", num_envs=2, continuous_actions=True)
    env.reset(seed=0)
    actions = torch.rand(2, 2, 15, generator=torch.Generator().manual_seed(1))
    out = env.step({"agents": actions})
    # Agent i hears the other agent's 10 message components as they were sent.
    torch.testing.assert_close(out.obs["agents"][..., 11:], actions[:, [1, 0], 5:])
    torch.testing.assert_close(env.get_state()["agent_comm"], actions[..., 5:])
    # The state is a copy: editing the action tensor afterwards changes nothing.
    actions.zero_()
    assert env.get_state()["agent_comm"].abs().sum() > 0
    speaker = make("mpe/simple_speaker_listener", num_envs=2, continuous_actions=True)
    said = torch.tensor([[[0.1, 0.7, 0.2]], [[1.0, 0.0, 0.5]]])
    out = speaker.step({"speaker": said, "listener": torch.zeros(2, 1, 5)})
    torch.testing.assert_close(out.obs["listener"][:, 0, 8:], said[:, 0])
    # The listener is silent and the speaker fixed, as in discrete mode.
    assert torch.equal(speaker.get_state()["agent_comm"][:, 1], torch.zeros(2, 3))


def test_continuous_force_directions() -> None:
    """mpe2's components: 1 pushes -x, 2 +x, 3 -y, 4 +y, 0 nothing; force 5 per unit."""
    env = make("mpe/simple_spread_continuous", num_envs=5, num_agents=1, num_landmarks=0)
    env.reset(seed=0)
    env.step({"agents": torch.eye(5).view(5, 1, 5)})
    vel = env.get_state()["agent_vel"][:, 0]
    expected = 0.5 * torch.tensor([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0]])
    torch.testing.assert_close(vel, expected)


# -- state injection and rendering -------------------------------------------------------------
@pytest.mark.parametrize("name", [c.name for c in CASES.values()])
def test_continuous_get_state_set_state_and_render(name: str) -> None:
    env = make(name, num_envs=3, continuous_actions=True)
    env.reset(seed=0)
    plan = [_episode_actions(env, s) for s in (0, 1, 2)]
    actions = [{g: torch.cat([p[t][g] for p in plan]) for g in env.spec.groups} for t in range(20)]
    for a in actions[:6]:
        env.step(a)
    saved = env.get_state()
    first = [env.step(a) for a in actions[6:]]
    frame = env.render(env_index=2, size=200)
    assert frame.shape == (200, 200, 3) and frame.dtype == np.uint8
    env.reset(seed=9)
    env.set_state(saved)
    second = [env.step(a) for a in actions[6:]]
    for x, y in zip(first, second, strict=True):
        for g in x.obs:
            assert torch.equal(x.final_obs[g], y.final_obs[g])
            assert torch.equal(x.reward[g], y.reward[g])
    assert np.array_equal(env.render(env_index=2, size=200), frame)
