"""The PettingZoo and Gymnasium adapters: equivalence with the wrapped envs, groups, masks,
death masking, malformed output, config names and missing packages.

Fault handling of worker processes (raise, hang, kill) is in ``test_adapter_faults.py``.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces
from test_adapter_envs import ScoredTinyEnv, TinyEnv, tiny

from mappo import config as config_mod
from mappo.algos.mappo import compute_returns
from mappo.envs import ActionError, EnvError, make
from mappo.envs.adapters import (
    EnvOutputError,
    EnvWorkerError,
    GymnasiumAdapter,
    PettingZooAdapter,
)
from mappo.envs.adapters._worker import copy_seed
from mappo.trainer import Trainer

mpe2 = pytest.importorskip("mpe2")
from mpe2 import simple_spread_v3  # noqa: E402


def random_actions(env, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Uniform actions ``[E, n, k]`` for every group, respecting the current masks."""
    out = {}
    for name, group in env.spec.groups.items():
        heads = [
            torch.randint(0, n, (env.num_envs, group.num_agents, 1), generator=generator)
            for n in group.action.nvec
        ]
        out[name] = torch.cat(heads, dim=-1)
    return out


# -- equivalence with the wrapped env ------------------------------------------------------------
@pytest.mark.parametrize(("num_workers", "global_state"), [(0, "auto"), (2, "env")])
def test_spread_matches_a_direct_loop_step_for_step(num_workers: int, global_state: str) -> None:
    """Same seeds and actions: the adapter's output equals stepping the mpe2 envs by hand,
    across an auto-reset (the episode limit of Spread is 25 steps). The global state is mpe2's
    ``state()`` (``"env"``) or the same values joined by the adapter (``"auto"``)."""
    num_envs, seed, steps = 4, 7, 30
    env = make(
        "pettingzoo:mpe2.simple_spread_v3",
        num_envs=num_envs,
        seed=seed,
        num_workers=num_workers,
        global_state=global_state,
    )
    assert env.num_workers == num_workers
    assert list(env.spec.groups) == ["agent"]
    assert env.spec.groups["agent"].obs_shape == (18,)
    assert env.spec.state_shape == (54,)
    assert env.spec.episode_limit == 25
    agents = env.spec.groups["agent"].agents

    direct = [simple_spread_v3.parallel_env() for _ in range(num_envs)]
    first = [d.reset(seed=copy_seed(seed, i))[0] for i, d in enumerate(direct)]
    out = env.reset()
    expected = np.stack([[first[i][a] for a in agents] for i in range(num_envs)])
    np.testing.assert_array_equal(out.obs["agent"].numpy(), expected)
    np.testing.assert_array_equal(out.state.numpy(), np.stack([d.state() for d in direct]))

    rng = np.random.default_rng(0)
    for t in range(steps):
        acts = rng.integers(0, 5, size=(num_envs, 3))
        out = env.step({"agent": torch.as_tensor(acts)})
        for i, d in enumerate(direct):
            obs, rew, term, trunc, _ = d.step({a: int(acts[i, j]) for j, a in enumerate(agents)})
            final_obs = np.stack([obs[a] for a in agents])
            np.testing.assert_array_equal(out.final_obs["agent"][i].numpy(), final_obs)
            np.testing.assert_allclose(
                out.reward["agent"][i].numpy(), [rew[a] for a in agents], rtol=1e-6
            )
            assert bool(out.truncated[i]) == all(trunc.values())
            assert not bool(out.terminated[i])
            if not d.agents:
                assert t + 1 == 25
                np.testing.assert_array_equal(out.final_state[i].numpy(), d.state())
                assert out.stats["episode_length"][i] == 25
                obs, _ = d.reset()
            np.testing.assert_array_equal(
                out.obs["agent"][i].numpy(), np.stack([obs[a] for a in agents])
            )
            np.testing.assert_array_equal(out.state[i].numpy(), d.state())
        assert bool(out.alive["agent"].all())
    env.close()


def test_same_seed_replays_and_reset_continues_the_rng() -> None:
    a = PettingZooAdapter("mpe2.simple_spread_v3", num_envs=3, seed=1, num_workers=0)
    b = PettingZooAdapter("mpe2.simple_spread_v3", num_envs=3, seed=1, num_workers=0)
    first = a.reset().obs["agent"]
    assert torch.equal(first, b.reset().obs["agent"])
    assert not torch.equal(first[0], first[1])  # copy i is seeded copy_seed(1, i)
    assert torch.equal(a.reset(seed=1).obs["agent"], first)
    assert not torch.equal(a.reset().obs["agent"], first)  # a None seed continues the RNG
    assert torch.equal(a.reset(seed=5).obs["agent"], b.reset(seed=5).obs["agent"])
    # Copy 1 of seed 1 is not copy 0 of seed 2: the runs of two seeds share no env stream.
    assert not torch.equal(a.reset(seed=1).obs["agent"][1], b.reset(seed=2).obs["agent"][0])
    seeds = {copy_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400


def test_config_names_pass_keyword_arguments_through() -> None:
    env = make(
        "pettingzoo:mpe2.simple_spread_v3:parallel_env",
        num_envs=2,
        num_workers=0,
        N=2,
        max_cycles=4,
    )
    assert env.spec.groups["agent"].agents == ("agent_0", "agent_1")
    assert env.spec.groups["agent"].obs_shape == (12,)
    assert env.spec.episode_limit == 4
    env.reset()
    for _ in range(3):
        out = env.step({"agent": torch.zeros(2, 2, 1, dtype=torch.int64)})
        assert not bool(out.done.any())
    out = env.step({"agent": torch.zeros(2, 2, dtype=torch.int64)})
    assert bool(out.truncated.all()) and not bool(out.terminated.any())
    assert out.stats["episode_length"].tolist() == [4.0, 4.0]
    env.close()

    env = make("pettingzoo:mpe2.simple_spread_v3", num_envs=1, num_workers=0, episode_limit=3)
    assert env.spec.episode_limit == 3  # an adapter option, not an env argument


def test_a_resume_may_spread_the_envs_over_other_workers(tmp_path: Path) -> None:
    # The adapter's worker count changes where the envs run, not what they do: a run moved to a
    # machine with other cores resumes with its own; the env's own arguments stay fixed.
    from mappo.config import ConfigError
    from mappo.trainer import resume, train

    tiny_run = {
        "env": {"num_envs": 2, "kwargs": {"num_workers": 0, "N": 2, "max_cycles": 5}},
        "rollout_length": 5,
        "total_env_steps": 10,
        "eval_episodes": 2,
        "progress": False,
    }
    run = train("pettingzoo/simple_spread", tiny_run, run_dir=tmp_path)
    resumed = resume(run.dir, ["total_env_steps=20", "env.kwargs.num_workers=1"])
    assert resumed.summary["env_steps"] == 20
    assert resumed.config.env.kwargs == {"num_workers": 1, "N": 2, "max_cycles": 5}
    with pytest.raises(ConfigError, match="'env.kwargs' cannot change when resuming"):
        resume(run.dir, ["total_env_steps=30", "env.kwargs.N=3"])


def test_readme_own_env_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's "PettingZoo env of your own" module, trained for one update with its command.
    from mappo import config as C
    from mappo.trainer import Trainer

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    module = next(
        b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "my_pz_envs" in b
    )
    (tmp_path / "my_pz_envs.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    command = next(line for line in readme.splitlines() if "env.name=pettingzoo:my_pz_envs" in line)
    assert command.startswith("mappo train pettingzoo/simple_spread env.name=pettingzoo:my_pz_envs")
    cfg = C.load(
        "pettingzoo/simple_spread",
        {
            "env.name": "pettingzoo:my_pz_envs",
            "env.kwargs": {"max_cycles": 25, "num_workers": 0},
            "progress": False,
            "total_env_steps": 250,
            "run_dir": str(tmp_path / "runs"),
        },
    )
    trainer = Trainer(cfg)
    assert trainer.env.spec.groups["agent"].num_agents == 3
    trainer.iterate()
    assert trainer.env_steps == 250
    trainer.close()


def test_bad_inputs_are_clear_errors() -> None:
    env = PettingZooAdapter(tiny(), num_envs=2, num_workers=0)
    with pytest.raises(EnvError, match="call reset"):
        env.step({"agent": torch.zeros(2, 2, dtype=torch.int64)})
    env.reset()
    with pytest.raises(ActionError, match="shape"):
        env.step({"agent": torch.zeros(2, 3, dtype=torch.int64)})
    with pytest.raises(ActionError, match="out of range"):
        env.step({"agent": torch.full((2, 2), 4, dtype=torch.int64)})
    with pytest.raises(NotImplementedError, match="state injection"):
        env.get_state()
    with pytest.raises(EnvError, match="num_workers=5 is more than num_envs=2"):
        PettingZooAdapter(tiny(), num_envs=2, num_workers=5)
    with pytest.raises(EnvError, match="set only one of num_workers and envs_per_worker"):
        PettingZooAdapter(tiny(), num_envs=8, num_workers=3, envs_per_worker=4)
    with pytest.raises(EnvError, match="bad parameter"):
        PettingZooAdapter(tiny(no_such_argument=1), num_envs=1, num_workers=0)
    with pytest.raises(EnvError, match="episode_limit=<steps>"):
        PettingZooAdapter(_NoLimitEnv, num_envs=1, num_workers=0)
    with pytest.raises(EnvError, match="picklable"):
        PettingZooAdapter(lambda: TinyEnv(), num_envs=2, num_workers=1)
    # An AEC env's reset() returns None: the error says to give its parallel form.
    with pytest.raises(EnvError, match="PettingZoo AEC env .* give its parallel form"):
        PettingZooAdapter("mpe2.simple_spread_v3:env", num_envs=1, num_workers=0)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_box_actions_reach_the_env_in_their_shape(num_workers: int) -> None:
    env = PettingZooAdapter(tiny(box_actions=True), num_envs=2, num_workers=num_workers)
    try:
        action = env.spec.groups["agent"].action
        assert action.continuous and action.low == (-1.0,) * 4 and action.high == (1.0,) * 4
        env.reset(seed=0)
        a = torch.tensor([[0.5, -0.25, 1.0, 0.125], [-1.0, 0.0, 0.0, 0.75]])
        out = env.step({"agent": a.expand(2, 2, 4).contiguous()})
        # TinyEnv observes the sum of its last action: the (2, 2) box arrived whole, as float32.
        torch.testing.assert_close(out.obs["agent"][:, :, 2], a.sum(-1).expand(2, 2))
        with pytest.raises(ActionError, match="outside the box"):
            env.step({"agent": torch.full((2, 2, 4), 1.5)})
        with pytest.raises(ActionError, match="floating dtype"):
            env.step({"agent": torch.zeros(2, 2, 4, dtype=torch.int64)})
    finally:
        env.close()


@pytest.mark.parametrize("masks", ["obs", "info"])
def test_a_box_with_an_action_mask_is_refused(masks: str) -> None:
    with pytest.raises(EnvError, match="masks apply to discrete actions only"):
        PettingZooAdapter(tiny(box_actions=True, masks=masks), num_envs=1, num_workers=0)


class _NoLimitEnv(TinyEnv):
    def __init__(self) -> None:
        super().__init__()
        self.max_cycles = None


# -- groups ----------------------------------------------------------------------------------------
def test_heterogeneous_agents_are_grouped_by_spaces() -> None:
    env = make("pettingzoo:mpe2.simple_speaker_listener_v4", num_envs=2, num_workers=0)
    groups = env.spec.groups
    assert list(groups) == ["speaker", "listener"]
    assert groups["speaker"].obs_shape == (3,) and groups["speaker"].action.nvec == (3,)
    assert groups["listener"].obs_shape == (11,) and groups["listener"].action.nvec == (5,)
    out = env.reset()
    assert out.obs["speaker"].shape == (2, 1, 3) and out.obs["listener"].shape == (2, 1, 11)
    out = env.step(random_actions(env, torch.Generator().manual_seed(0)))
    assert out.reward["speaker"].shape == (2, 1)

    env = make("pettingzoo:mpe2.simple_adversary_v3", num_envs=1, num_workers=0)
    assert {g: s.agents for g, s in env.spec.groups.items()} == {
        "adversary": ("adversary_0",),
        "agent": ("agent_0", "agent_1"),
    }


def test_group_names_fall_back_and_multidiscrete_actions() -> None:
    # Two groups whose agents share the prefix "agent": named group_0 and group_1.
    env = PettingZooAdapter(tiny(n_agents=3, odd_one=True, scouts=1), num_envs=2, num_workers=0)
    groups = env.spec.groups
    assert {g: s.agents for g, s in groups.items()} == {
        "group_0": ("agent_0", "agent_1"),
        "group_1": ("agent_2",),
        "scout": ("scout_0",),
    }
    assert groups["scout"].action.nvec == (2, 3) and groups["group_1"].obs_shape == (5,)
    # No state() in the env: the state is every group's observations, joined.
    assert env.spec.state_shape == (2 * 4 + 5 + 5,)
    env.reset()
    actions = {
        "group_0": torch.tensor([[[1], [2]], [[3], [0]]]),
        "group_1": torch.tensor([[[1]], [[2]]]),
        "scout": torch.tensor([[[1, 2]], [[0, 1]]]),
    }
    out = env.step(actions)
    # TinyEnv's observation is [t, agent index, sum of the last action, noise].
    assert out.obs["scout"][:, 0, 2].tolist() == [3.0, 1.0]
    assert out.obs["group_0"][:, :, 2].tolist() == [[1.0, 2.0], [3.0, 0.0]]
    assert out.reward["scout"][:, 0].tolist() == pytest.approx([0.3 + 3, 0.1 + 3])
    joined = torch.cat([out.obs[g].flatten(1) for g in groups], dim=1)
    assert torch.equal(out.state, joined)


def test_user_groups_and_their_checks() -> None:
    groups = {"first": ["agent_0"], "rest": ["agent_1", "agent_2"]}
    env = make("pettingzoo:mpe2.simple_spread_v3", num_envs=1, num_workers=0, groups=groups)
    assert {g: s.agents for g, s in env.spec.groups.items()} == {
        "first": ("agent_0",),
        "rest": ("agent_1", "agent_2"),
    }
    out = env.reset()
    assert out.obs["rest"].shape == (1, 2, 18)
    name = "pettingzoo:mpe2.simple_adversary_v3"
    for bad, message in (
        ({"a": ["adversary_0", "agent_0", "agent_1"]}, "mixes agents with different spaces"),
        ({"a": ["adversary_0"], "b": ["agent_0"]}, r"agents \['agent_1'\] are in no group"),
        ({"a": ["adversary_0", "spy_0"], "b": ["agent_0", "agent_1"]}, "does not have"),
        ({"a": ["adversary_0"], "b": ["agent_0", "agent_1", "agent_0"]}, "exactly one group"),
    ):
        with pytest.raises(EnvError, match=message):
            make(name, num_envs=1, num_workers=0, groups=bad)


# -- masks and death masking -------------------------------------------------------------------
@pytest.mark.parametrize("masks", ["obs", "info"])
def test_action_masks_come_from_observations_or_infos(masks: str) -> None:
    env = PettingZooAdapter(tiny(masks=masks, scouts=1), num_envs=2, num_workers=0)
    assert env.spec.groups["agent"].has_action_mask
    assert env.spec.groups["agent"].obs_shape == (4,)  # the mask is not in the observation
    out = env.reset()
    # t = 0: even actions allowed (and 0 always).
    assert out.action_mask["agent"][0, 0].tolist() == [True, False, True, False]
    assert out.action_mask["scout"][0, 0].tolist() == [True, False, True, False, True]
    zeros = {
        g: torch.zeros(2, s.num_agents, s.action.num_heads, dtype=torch.int64)
        for g, s in env.spec.groups.items()
    }
    out = env.step(zeros)
    assert out.action_mask["agent"][1, 1].tolist() == [True, True, False, True]
    forbidden = dict(zeros, agent=torch.full((2, 2, 1), 2, dtype=torch.int64))
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step(forbidden)
    env.validate_actions = False
    env.step(forbidden)  # the trainer's hot loop: no checks


def test_an_agent_that_leaves_is_dead_until_the_episode_ends() -> None:
    env = PettingZooAdapter(tiny(leave={"agent_1": 2}, max_cycles=4), num_envs=2, num_workers=0)
    env.reset()
    ones = {"agent": torch.ones(2, 2, dtype=torch.int64)}
    out = env.step(ones)
    assert out.alive["agent"].all()
    out = env.step(ones)  # agent_1 terminates in this step: its last reward counts
    assert out.alive["agent"][:, 0].all() and not out.alive["agent"][:, 1].any()
    assert out.reward["agent"][0].tolist() == pytest.approx([0.1, 1.1])
    assert (out.obs["agent"][:, 1] == 0).all() and not bool(out.done.any())
    out = env.step(ones)
    assert not out.alive["agent"][:, 1].any() and (out.obs["agent"][:, 1] == 0).all()
    assert out.reward["agent"][0].tolist() == pytest.approx([0.1, 0.0])
    out = env.step(ones)  # agent_0 is truncated at the limit: the episode is over
    assert out.truncated.all() and not out.terminated.any()
    assert out.alive["agent"].all() and (out.obs["agent"][:, :, 0] == 0).all()  # new episode
    assert (out.final_obs["agent"][:, 0, 0] == 4).all()  # agent_0's last observation
    assert (out.final_obs["agent"][:, 1] == 0).all()
    expected_return = (4 * 0.1 + 2 * 1.1) / 2  # summed over steps, averaged over agents
    assert out.stats["episode_return"].tolist() == pytest.approx([expected_return] * 2)


def test_an_agent_that_leaves_ends_its_own_returns_and_earns_nothing_after() -> None:
    # The env keeps rewarding agent_1 after it terminated (as envs that report every possible
    # agent do): those rewards belong to no action of its, and are not recorded.
    factory = tiny(leave={"agent_1": 2}, max_cycles=4, fault="ghost_rewards")
    env = PettingZooAdapter(factory, num_envs=1, num_workers=0)
    assert env.agent_terminations
    env.reset()
    ones = {"agent": torch.ones(1, 2, dtype=torch.int64)}
    steps = [env.step(ones) for _ in range(4)]
    assert [s.agent_terminated["agent"][0].tolist() for s in steps] == [
        [False, False],
        [False, True],  # agent_1's own episode ends here, while the env goes on
        [False, False],
        [False, False],
    ]
    assert [s.reward["agent"][0, 1].item() for s in steps] == pytest.approx([1.1, 1.1, 0, 0])
    assert bool(steps[-1].truncated) and steps[-1].stats["episode_return"].item() == (
        pytest.approx((4 * 0.1 + 2 * 1.1) / 2)
    )


def test_an_agent_that_leaves_is_not_bootstrapped_past_its_last_step() -> None:
    # MAPPO's returns: agent_1 terminates at step 2 of an episode that goes on. Its target at
    # that step is its reward alone, whatever the critic makes of its death-masked input.
    cfg = config_mod.load(
        "pettingzoo/simple_spread",
        {
            "env.name": "pettingzoo:test_adapter_envs:TinyEnv",
            "env.kwargs": {"leave": {"agent_1": 2}, "max_cycles": 6, "num_workers": 0},
            "env.num_envs": 1,
            "rollout_length": 6,
            "threads": 1,
            "algo.value_norm": "none",
        },
    )
    trainer = Trainer(cfg)
    try:
        learner = trainer.learner
        with torch.no_grad():  # a critic far from 0 on every input, the dead one's included
            for name, param in learner.policy.critics["agent"].named_parameters():
                param.fill_(0.0 if "weight" in name else 5.0)
        ro = learner.collector.collect()
        buf = ro.groups["agent"]
        assert buf.agent_terminated[1, 0].tolist() == [False, True]
        _, returns = compute_returns(learner.policy, ro, cfg.algo)["agent"]
        assert returns[1, 0, 1].item() == pytest.approx(buf.rewards[1, 0, 1].item())
        # Without the flag, the dead input's value of 5 was bootstrapped into that target.
        flags, buf.agent_terminated = buf.agent_terminated, None
        _, before = compute_returns(learner.policy, ro, cfg.algo)["agent"]
        assert before[1, 0, 1].item() > buf.rewards[1, 0, 1].item() + 0.5
        # agent_0 goes on: bootstrapped as before
        buf.agent_terminated = flags
        assert returns[:, :, 0].tolist() == before[:, :, 0].tolist()
    finally:
        trainer.close()


def test_an_episode_that_every_agent_leaves_is_terminated() -> None:
    leave = {"agent_0": 3, "agent_1": 2}
    env = PettingZooAdapter(tiny(leave=leave, max_cycles=10), num_envs=1, num_workers=0)
    env.reset()
    ones = {"agent": torch.ones(1, 2, dtype=torch.int64)}
    assert [bool(env.step(ones).terminated) for _ in range(3)] == [False, False, True]


def test_the_episode_limit_truncates_an_env_that_reports_termination() -> None:
    leave = {"agent_0": 3, "agent_1": 3}
    for truncate_at_limit, expected in ((True, "truncated"), (False, "terminated")):
        env = PettingZooAdapter(
            tiny(leave=leave),
            num_envs=1,
            num_workers=0,
            episode_limit=3,
            truncate_at_limit=truncate_at_limit,
        )
        env.reset()
        for _ in range(3):
            out = env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
        assert bool(getattr(out, expected)) and bool(out.done)


# -- episode statistics and rendering -----------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_episode_statistics_come_from_the_infos_of_the_last_step(num_workers: int) -> None:
    factory = functools.partial(ScoredTinyEnv, max_cycles=3)
    with PettingZooAdapter(factory, num_envs=2, num_workers=num_workers) as env:
        assert env.spec.stat_names == ("episode_return", "episode_length", "steps_played", "bonus")
        env.reset(seed=0)
        ones = {"agent": torch.ones(2, 2, 1, dtype=torch.int64)}
        for t in range(1, 4):
            out = env.step(ones)
            if t < 3:  # nothing is reported before an episode ends
                assert out.stats["steps_played"].tolist() == [0.0, 0.0]
        assert out.truncated.all()
        assert out.stats["steps_played"].tolist() == [3.0, 3.0]
        assert out.stats["bonus"].tolist() == [1.5, 1.5]
        assert out.stats["episode_length"].tolist() == [3.0, 3.0]
    # The option overrides the env's list; names it cannot find, or that are not numbers, are
    # reported with the env, the copy and the fix.
    with PettingZooAdapter(factory, num_envs=1, num_workers=0, episode_stats=["bonus"]) as env:
        assert env.spec.stat_names[2:] == ("bonus",)
    bad = functools.partial(ScoredTinyEnv, max_cycles=1, stat_value="high")
    with PettingZooAdapter(bad, num_envs=1, num_workers=0, name="s") as env:
        env.reset()
        with pytest.raises(EnvOutputError, match="s: copy 0: episode statistic 'bonus' is 'high'"):
            env.step({"agent": torch.ones(1, 2, 1, dtype=torch.int64)})
    with PettingZooAdapter(
        factory, num_envs=1, num_workers=0, name="s", episode_stats=["goals"]
    ) as env:
        env.reset()
        one = {"agent": torch.ones(1, 2, 1, dtype=torch.int64)}
        env.step(one)
        env.step(one)
        with pytest.raises(EnvOutputError, match="'goals' is in no agent's info .* drop it"):
            env.step({"agent": torch.ones(1, 2, 1, dtype=torch.int64)})
    # An episode the adapter cuts at its episode_limit reads 0 where the env reports nothing.
    long = functools.partial(ScoredTinyEnv, max_cycles=9)
    with PettingZooAdapter(long, num_envs=1, num_workers=0, episode_limit=2) as env:
        env.reset()
        one = {"agent": torch.ones(1, 2, 1, dtype=torch.int64)}
        env.step(one)
        out = env.step(one)
        assert out.truncated.item() and out.stats["bonus"].item() == 0.0
    for names, message in (
        ("bonus", "must be a list of names"),
        (["episode_return"], "must not name 'episode_return'"),
        (["truncated"], "must not name 'truncated'"),
        (["a", "a"], "names a statistic twice"),
        (["no spaces"], "must be identifiers"),
    ):
        with pytest.raises(EnvError, match=message):
            PettingZooAdapter(factory, num_envs=1, num_workers=0, episode_stats=names)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_render_draws_the_copy_in_its_worker(num_workers: int) -> None:
    factory = functools.partial(ScoredTinyEnv, render_mode="rgb_array", max_cycles=9)
    with PettingZooAdapter(factory, num_envs=2, num_workers=num_workers, name="s") as env:
        with pytest.raises(EnvError, match="call reset"):
            env.render(0)
        env.reset(seed=3)
        env.step({"agent": torch.ones(2, 2, 1, dtype=torch.int64)})
        frame = env.render(1)  # copy 1 was seeded copy_seed(3, 1), and has taken one step
        drawn = [(10 * copy_seed(3, i) + 1) % 256 for i in range(2)]
        assert drawn[0] != drawn[1]
        assert frame.shape == (8, 12, 3) and frame.dtype == np.uint8 and (frame == drawn[1]).all()
        assert (env.render(0) == drawn[0]).all()
        with pytest.raises(EnvError, match="env_index must be in 0..1"):
            env.render(2)
        env.step({"agent": torch.ones(2, 2, 1, dtype=torch.int64)})  # the batch still steps
    # An env made without render_mode returns None: a clear error, and the batch lives on.
    with PettingZooAdapter(ScoredTinyEnv, num_envs=2, num_workers=num_workers, name="s") as env:
        env.reset()
        with pytest.raises(NotImplementedError, match="render\\(\\) returned None"):
            env.render(0)
        env.step({"agent": torch.ones(2, 2, 1, dtype=torch.int64)})
    # A render() that raises, or returns no frame, is an EnvError naming the copy; the batch
    # lives on. A worker that dies while drawing closes the batch like a fault in a step.
    for fault, message in (
        ("raise", "s: render\\(\\) of copy 1 raised RuntimeError: no canvas"),
        (
            "shape",
            "s: render\\(\\) of copy 1 raised ValueError: render\\(\\) returned shape \\(8, 12\\)",
        ),
    ):
        factory = functools.partial(ScoredTinyEnv, render_fault=fault)
        with PettingZooAdapter(factory, num_envs=2, num_workers=num_workers, name="s") as env:
            env.reset()
            with pytest.raises(EnvError, match=message):
                env.render(1)
            env.step({"agent": torch.ones(2, 2, 1, dtype=torch.int64)})


def test_a_worker_that_dies_while_drawing_closes_the_batch() -> None:
    factory = functools.partial(ScoredTinyEnv, render_mode="rgb_array")
    env = PettingZooAdapter(factory, num_envs=2, num_workers=2, name="s")
    env.reset()
    os.kill(env.worker_pids[1], signal.SIGKILL)
    with pytest.raises(EnvWorkerError, match="s: worker 1 .* was killed by SIGKILL during render"):
        env.render(1)
    with pytest.raises(EnvError, match="s is closed after an error"):
        env.step({"agent": torch.ones(2, 2, 1, dtype=torch.int64)})


# -- malformed output --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("nan", "agent 'agent_1' in copy 0 of the batch returned a reward with NaN"),
        ("shape", r"agent 'agent_0' in copy 0 of the batch returned an observation of shape"),
        ("unknown_agent", "agent 'ghost_0' .* is not one of the env's possible_agents"),
        (
            "array_reward",
            r"agent 'agent_0' in copy 0 of the batch returned a reward of an array of shape "
            r"\(1,\) and dtype float64; a reward is one number",
        ),
    ],
)
def test_malformed_output_is_refused_with_agent_and_env_names(fault: str, message: str) -> None:
    env = PettingZooAdapter(tiny(fault=fault), num_envs=1, num_workers=0, name="tiny")
    env.reset()
    env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
    with pytest.raises(EnvOutputError, match=message) as info:
        env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
    assert info.value.env_name == "tiny" and str(info.value).startswith("tiny: ")
    with pytest.raises(EnvError, match="closed after an error"):
        env.reset()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("no_reward", "agent 'agent_0' in copy 0 of the batch acted but the env returned no "),
        ("four_tuple", r"step\(\) must return \(observations, rewards, terminations, truncation"),
    ],
)
def test_a_step_the_parallel_api_does_not_allow_is_named(fault: str, message: str) -> None:
    """A reward left out for an agent that acted (it read as 0) and the older API's 4-tuple
    step (an unpacking error blamed on the env) are named as what they are."""
    env = PettingZooAdapter(tiny(fault=fault, fault_step=2), num_envs=1, num_workers=0, name="t")
    env.reset()
    env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
    with pytest.raises(EnvOutputError, match=message):
        env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})


def test_an_ended_agent_left_in_env_agents_is_refused() -> None:
    """PettingZoo's parallel API removes an agent whose termination came from env.agents; one
    left there would act on and have its rewards trained on while marked not alive."""
    env = PettingZooAdapter(
        tiny(fault="stays", leave={"agent_0": 1}), num_envs=1, num_workers=0, name="t"
    )
    env.reset()
    out = env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
    assert not bool(out.alive["agent"][0, 0])
    with pytest.raises(EnvOutputError, match="'agent_0' in copy 0 of the batch is still in env"):
        env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("reset_raise", "the environment's reset\\(\\) raised RuntimeError: reset boom"),
        ("state_raise", "the environment's state\\(\\) raised ValueError: state boom"),
        ("reset_obs_only", "reset\\(\\) must return \\(observations, infos\\)"),
        ("reset_text_obs", "the observation of agent 'agent_0' after reset\\(\\) does not fit"),
        ("reset_array_obs", r"does not fit its observation space Dict\(.*\) \(it returned "
         r"ndarray of shape \(3,\): IndexError"),
    ],
)  # fmt: skip
def test_a_fault_while_the_env_is_inspected_is_one_clear_error(fault: str, message: str) -> None:
    masks = "obs" if fault == "reset_array_obs" else None
    with pytest.raises(EnvError, match=message) as info:
        PettingZooAdapter(tiny(fault=fault, masks=masks), num_envs=1, num_workers=0, name="tiny")
    assert str(info.value).startswith("tiny: ")


def test_a_state_that_raises_names_the_fix_which_never_calls_it() -> None:
    with pytest.raises(EnvError, match="state boom; global_state=obs gives the critic"):
        PettingZooAdapter(tiny(fault="state_raise"), num_envs=1, num_workers=0, name="tiny")
    env = PettingZooAdapter(
        tiny(fault="state_raise"), num_envs=2, num_workers=0, name="tiny", global_state="obs"
    )
    env.reset()
    out = env.step({"agent": torch.ones(2, 2, dtype=torch.int64)})
    assert out.state.shape == (2, 8)  # both agents' observations, joined


def test_masks_only_in_step_infos_are_refused_not_ignored() -> None:
    # The mask mode is read from reset's infos: a mask that appears only later would have been
    # dropped without a word, training on forbidden actions.
    env = PettingZooAdapter(tiny(masks="step_info"), num_envs=1, num_workers=0, name="tiny")
    assert not env.spec.groups["agent"].has_action_mask
    env.reset()
    with pytest.raises(EnvOutputError, match="has an 'action_mask' in its info, but its first"):
        env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})


def test_an_env_error_in_process_names_the_copy_and_keeps_the_traceback() -> None:
    env = PettingZooAdapter(
        tiny(fault="raise", fault_seed=copy_seed(10, 1)), num_envs=3, seed=10, num_workers=0
    )
    env.reset()
    env.step({"agent": torch.ones(3, 2, dtype=torch.int64)})
    with pytest.raises(
        EnvWorkerError, match="RuntimeError: boom at step 2 in step in copy 1"
    ) as info:
        env.step({"agent": torch.ones(3, 2, dtype=torch.int64)})
    assert info.value.env_index == 1 and info.value.worker is None
    assert "test_adapter_envs.py" in info.value.remote_traceback


# -- Gymnasium multi-agent envs ----------------------------------------------------------------
def test_lbf_runs_through_the_gymnasium_adapter() -> None:
    pytest.importorskip("lbforaging")
    env = make("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", num_envs=2, seed=3, num_workers=1)
    assert isinstance(env, GymnasiumAdapter)
    group = env.spec.groups["agent"]
    assert group.agents == ("agent_0", "agent_1") and group.action.nvec == (6,)
    assert group.obs_shape == (12,) and env.spec.episode_limit == 50
    env.reset()
    gen = torch.Generator().manual_seed(0)
    ended, total = 0, 0.0
    for _ in range(200):
        out = env.step(random_actions(env, gen))
        ended += int(out.done.sum())
        total += float(out.reward["agent"].sum())
        assert torch.isfinite(out.obs["agent"]).all()
        # LBF ends an episode when the food is gone (terminated) or after 50 steps.
        lengths = out.stats["episode_length"][out.done]
        assert ((lengths == 50) == out.truncated[out.done]).all()
    assert ended >= 8 and total >= 0
    env.close()


def test_lbf_replays_with_the_same_seed() -> None:
    pytest.importorskip("lbforaging")
    runs = []
    for _ in range(2):
        env = GymnasiumAdapter(
            "lbforaging:Foraging-8x8-2p-2f-v3", num_envs=2, seed=4, num_workers=0
        )
        obs = [env.reset().obs["agent"]]
        actions = torch.tensor([[[1], [4]], [[2], [3]]])
        obs += [env.step({"agent": actions}).obs["agent"] for _ in range(60)]
        runs.append(torch.stack(obs))
    assert torch.equal(runs[0], runs[1])


def test_rware_runs_through_the_gymnasium_adapter() -> None:
    pytest.importorskip("rware")
    env = make("gymnasium:rware:rware-tiny-2ag-v2", num_envs=2, num_workers=0, max_steps=120)
    group = env.spec.groups["agent"]
    assert group.agents == ("agent_0", "agent_1") and group.obs_shape == (71,)
    assert group.action.nvec == (5,) and env.spec.episode_limit == 120
    env.reset(seed=0)
    gen = torch.Generator().manual_seed(1)
    dones = []
    for _ in range(300):
        out = env.step(random_actions(env, gen))
        dones.append(out.done)
        assert torch.isfinite(out.reward["agent"]).all()
    dones = torch.stack(dones)
    # RWARE signals its step limit as terminated=True; the adapter reports a truncation.
    assert dones.sum(0).tolist() == [2, 2] and dones[119].all() and dones[239].all()


def test_a_gymnasium_env_without_tuple_spaces_is_refused() -> None:
    with pytest.raises(EnvError, match="gymnasium.spaces.Tuple"):
        GymnasiumAdapter("CartPole-v1", num_envs=1, num_workers=0)


class _TwoAgentTuple(gymnasium.Env):
    """A Gymnasium env of Tuple spaces for two agents whose ``mode`` is one mistake."""

    def __init__(self, mode: str = "") -> None:
        self.mode = mode
        self.observation_space = spaces.Tuple([spaces.Box(-1, 1, (3,), np.float32)] * 2)
        self.action_space = spaces.Tuple([spaces.Discrete(2)] * 2)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple:
        obs = (np.zeros(3, np.float32),) * 2
        return obs if self.mode == "reset_obs_only" else (obs, {})

    def step(self, actions: tuple) -> tuple:
        obs = (np.zeros(3, np.float32),) * (1 if self.mode == "one_obs" else 2)
        return obs, [1.0, 1.0], False, False, {}


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("reset_obs_only", r"reset\(\) returned 3 observations for 2 agents"),
        ("one_obs", r"step\(\) returned 1 observation for 2 agents; a Tuple observation space"),
    ],
)
def test_a_tuple_env_with_too_few_observations_says_so(mode: str, message: str) -> None:
    """Not zip()'s 'argument 2 is shorter than argument 1', blamed on the env."""
    env_id = f"mappo-test-tuple-{mode}-v0"
    gymnasium.register(env_id, entry_point=lambda: _TwoAgentTuple(mode), max_episode_steps=5)
    with pytest.raises(EnvError, match=message):
        env = GymnasiumAdapter(env_id, num_envs=1, num_workers=0)
        env.reset()
        env.step({"agent": torch.zeros(1, 2, 1, dtype=torch.int64)})


# -- missing packages --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "modules", "extra"),
    [
        ("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", ["lbforaging"], "lbf"),
        ("gymnasium:rware:rware-tiny-2ag-v2", ["rware"], "rware"),
        ("pettingzoo:mpe2.simple_spread_v3", ["mpe2", "mpe2.simple_spread_v3"], "pettingzoo"),
    ],
)
def test_a_missing_package_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, name: str, modules: list[str], extra: str
) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(EnvError, match=rf"pip install 'mappo\[{extra}\]'"):
        make(name, num_envs=1, num_workers=0)


def test_unknown_modules_are_reported_plainly() -> None:
    # No `pip install <name>` for a name the project does not know: that could install an
    # unrelated package of the same name; the usual cause is a folder missing from PYTHONPATH.
    with pytest.raises(EnvError) as info:
        make("pettingzoo:no_such_package_xyz.env_v0", num_envs=1, num_workers=0)
    assert str(info.value) == (
        "pettingzoo:no_such_package_xyz.env_v0: module 'no_such_package_xyz' is not importable; "
        "is its folder on PYTHONPATH (or the current directory), or is it installed?"
    )
    with pytest.raises(EnvError) as info:
        make("gymnasium:no_such_package_xyz:Thing-v0", num_envs=1, num_workers=0)
    assert "'no_such_package_xyz' is not importable" in str(info.value)
    assert "pip" not in str(info.value)
    with pytest.raises(EnvError, match="there is no module 'mpe2.no_such_env' in package 'mpe2'"):
        make("pettingzoo:mpe2.no_such_env", num_envs=1, num_workers=0)


MODULES = {
    # A module of the user's own, found only once its folder is on sys.path.
    "my_env_ok": "from test_adapter_envs import TinyEnv as parallel_env\n",
    "my_env_raises": "raise RuntimeError('bad config\\nsecond line')\n",
    "my_env_syntax": "def parallel_env(:\n",
    "my_env_needs_dep": "import no_such_dependency_xyz\n",
    "my_env_needs_extra": "import rware\n",
}


@pytest.fixture
def user_modules(tmp_path: Path) -> Iterator[Path]:
    """A folder holding :data:`MODULES` (not on ``sys.path``); the modules are forgotten after
    the test so that each test imports them afresh."""
    for module, source in MODULES.items():
        (tmp_path / f"{module}.py").write_text(source)
    yield tmp_path
    for module in MODULES:
        sys.modules.pop(module, None)


def test_a_user_module_off_the_path_asks_about_pythonpath(
    user_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(EnvError) as info:
        make("pettingzoo:my_env_ok", num_envs=1, num_workers=0)
    assert str(info.value) == (
        "pettingzoo:my_env_ok: module 'my_env_ok' is not importable; is its folder on "
        "PYTHONPATH (or the current directory), or is it installed?"
    )
    monkeypatch.syspath_prepend(str(user_modules))  # the fix the message names
    env = make("pettingzoo:my_env_ok", num_envs=1, num_workers=0)
    assert env.spec.groups["agent"].num_agents == 2
    env.close()


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            "my_env_raises",
            "importing module 'my_env_raises' raised RuntimeError: bad config; fix the error in "
            "that module",
        ),
        (
            "my_env_syntax",
            "importing module 'my_env_syntax' raised SyntaxError: ",  # then the file and line
        ),
        (
            "my_env_needs_dep",
            "importing module 'my_env_needs_dep' raised ModuleNotFoundError: No module named "
            "'no_such_dependency_xyz'; fix that import in the module or install what it needs",
        ),
    ],
)
def test_a_module_that_raises_on_import_is_one_line(
    user_modules: Path, monkeypatch: pytest.MonkeyPatch, module: str, message: str
) -> None:
    monkeypatch.syspath_prepend(str(user_modules))
    with pytest.raises(EnvError) as info:
        make(f"pettingzoo:{module}", num_envs=1, num_workers=0)
    text = str(info.value)
    assert text.startswith(f"pettingzoo:{module}: {message}")
    if module == "my_env_syntax":
        assert "(my_env_syntax.py, line 1); fix the error in that module" in text
    assert "\n" not in text and "Traceback" not in text and "pip" not in text


def test_a_user_module_that_needs_a_missing_extra_names_the_extra(
    user_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(user_modules))
    monkeypatch.setitem(sys.modules, "rware", None)  # makes the import fail
    with pytest.raises(EnvError) as info:
        make("pettingzoo:my_env_needs_extra", num_envs=1, num_workers=0)
    assert str(info.value) == (
        "pettingzoo:my_env_needs_extra needs the Python package 'rware', which is not installed; "
        "install it with `pip install 'mappo[rware]'`"
    )


def test_an_lbf_preset_without_its_packages_names_its_own_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its extra brings gymnasium too: the gymnasium hint (pettingzoo's extra) was a detour."""
    import importlib.util

    found = importlib.util.find_spec
    missing = {"lbforaging", "gymnasium"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else found(name, *a)
    )
    with pytest.raises(
        EnvError, match="'lbforaging', which is not installed; install it with `pip"
    ):
        make("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", num_envs=1, num_workers=0)
    with pytest.raises(EnvError, match="install it with `pip install 'mappo\\[lbf\\]'`"):
        make("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", num_envs=1, num_workers=0)


def test_the_python_example_in_the_docs_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).parents[1] / "docs" / "custom_envs.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert 'if __name__ == "__main__":' in block  # the worker processes import the script
    namespace: dict = {"__name__": "__main__"}
    exec(compile(block, "custom_envs.md", "exec"), namespace)
    printed = capsys.readouterr().out.strip()
    assert f"# {printed}" in block  # the output shown in the docs
    step = namespace["step"]
    assert step.obs["agent"].shape == (8, 2, 10) and step.obs["adversary"].shape == (8, 1, 8)
    assert namespace["env"].spec.episode_limit == 50


def test_spaces_that_raise_are_one_line() -> None:
    """An env whose observation_space() or action_space() raises (a Box with a NaN bound built
    on demand) was a traceback from the adapter's probe; it is one EnvError naming the agent."""

    class BadSpaces(ScoredTinyEnv):
        def action_space(self, agent: str) -> Any:
            raise KeyError(f"no space for {agent}")

    with pytest.raises(EnvError) as info:
        PettingZooAdapter(BadSpaces, num_envs=1, num_workers=0, name="bad")
    assert str(info.value) == (
        "bad: the environment's observation_space() or action_space() for agent 'agent_0' "
        "raised KeyError: 'no space for agent_0'"
    )


def test_terminations_at_the_episode_limit_are_the_truncation() -> None:
    # LBF and RWARE end at their limit by terminating every agent: with truncate_at_limit the
    # episode is truncated, and no agent's own termination may undo its bootstrap.
    leave = {"agent_0": 3, "agent_1": 3}
    env = PettingZooAdapter(tiny(leave=leave), num_envs=1, num_workers=0, episode_limit=3)
    env.reset()
    for _ in range(3):
        out = env.step({"agent": torch.ones(1, 2, dtype=torch.int64)})
    assert bool(out.truncated) and not out.agent_terminated["agent"].any()


def test_lbf_and_rware_draw_through_the_adapter(monkeypatch) -> None:
    # The Tuple-space wrapper had no render(): `mappo eval RUN --gif` failed on every LBF and
    # RWARE env. They draw with render(mode="rgb_array") through pyglet, which needs a display
    # (none here): a frame is imitated, and a missing display is one line saying what to do.
    pytest.importorskip("lbforaging")
    from lbforaging.foraging.environment import ForagingEnv

    asked = []

    def drawn(self, mode="human"):
        asked.append(mode)
        return np.zeros((40, 30, 3), dtype=np.uint8)

    monkeypatch.setattr(ForagingEnv, "render", drawn)
    env = make("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", num_envs=2, num_workers=0)
    env.reset(seed=1)
    assert env.render(1).shape == (40, 30, 3) and asked == ["rgb_array"]

    def no_display(self, mode="human"):
        raise RuntimeError('NoSuchDisplayException: Cannot connect to "None"')

    monkeypatch.setattr(ForagingEnv, "render", no_display)
    with pytest.raises(EnvError, match="needs a display: .* run the command under xvfb-run"):
        env.render(0)
    env.close()


def test_render_takes_a_preset_name_for_its_env(monkeypatch, tmp_path, capsys) -> None:
    # `mappo render lbf/8x8-2p-2f-coop` said "unknown environment", though `mappo list` lists
    # it (as a preset): its env is drawn, with the preset's env parameters.
    pytest.importorskip("lbforaging")
    import mappo.envs.registry
    from mappo.cli import main

    made = []

    def record(name, **kwargs):
        made.append((name, kwargs))
        raise EnvError("stop here")

    monkeypatch.setattr(mappo.envs.registry, "make", record)
    assert main(["render", "lbf/8x8-2p-2f-coop", "--gif", str(tmp_path / "a.gif")]) == 2
    ((name, kwargs),) = made
    assert name == "gymnasium:lbforaging:Foraging-8x8-2p-2f-coop-v3"
    assert "num_workers" not in kwargs and kwargs["num_envs"] == 1


def test_a_misspelt_adapter_option_is_named() -> None:
    # env.kwargs.num_worker=2 reached the env, which refused it; the message blamed the env
    pytest.importorskip("lbforaging")
    with pytest.raises(EnvError, match="did you mean the adapter's option 'num_workers'"):
        make("gymnasium:lbforaging:Foraging-8x8-2p-2f-v3", num_envs=1, num_worker=1)


def test_the_step_limit_of_pettingzoos_own_games_is_found():
    """PettingZoo's SISL and butterfly envs keep ``max_cycles`` on the game their class wraps:
    the adapter reads it there (it asked for episode_limit as well)."""
    pytest.importorskip("pygame")
    with make(
        "pettingzoo:pettingzoo.sisl.pursuit_v5", num_envs=1, num_workers=0, max_cycles=30
    ) as env:
        assert env.spec.episode_limit == 30


def test_a_turn_based_pettingzoo_game_is_named_as_such():
    """Tic-tac-toe has only an AEC env with no parallel form: the errors say that, instead of
    pointing to aec_to_parallel (which refuses such games) or to a bare missing attribute."""
    pytest.importorskip("pettingzoo.classic")
    with pytest.raises(EnvError, match="has no parallel form \\(a turn-based game"):
        make("pettingzoo:pettingzoo.classic.tictactoe_v3:env", num_envs=1, num_workers=0)
    with pytest.raises(EnvError, match="turn-based games, such as pettingzoo.classic's, have none"):
        make("pettingzoo:pettingzoo.classic.tictactoe_v3", num_envs=1, num_workers=0)
