"""VMAS scenarios as batched envs (mappo.envs.vmas): the contract every env keeps, and what is
particular to VMAS (its random numbers, its partial resets, its renderer)."""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest
import torch

vmas = pytest.importorskip("vmas")

from vmas.simulator.core import Agent, Sphere, World  # noqa: E402
from vmas.simulator.scenario import BaseScenario  # noqa: E402

from mappo.envs import ActionError, EnvError, list_envs, make  # noqa: E402
from mappo.envs.base import spec_from_dict, spec_to_dict  # noqa: E402
from mappo.envs.rendering import random_actions  # noqa: E402
from mappo.envs.vmas import KNOWN_SCENARIOS, scenario_names  # noqa: E402
from mappo.envs.vmas.env import BATCHED_RESET_SCENARIOS, VmasEnv, _MaskedReset  # noqa: E402


class Countdown(BaseScenario):
    """A one-agent scenario whose env ``i`` terminates after ``2 + i % 3`` steps; the
    observation is ``[x, y, steps so far]`` (the episode clock lives in a per-env tensor)."""

    def make_world(self, batch_dim: int, device: torch.device, **kwargs: object) -> World:
        world = World(batch_dim, device)
        world.add_agent(Agent(name="robot_0", shape=Sphere(0.1), u_range=0.5))
        self.t = torch.zeros(batch_dim, device=device)
        self.limit = torch.arange(batch_dim, device=device) % 3 + 2
        return world

    def reset_world_at(self, env_index: int | None = None) -> None:
        shape = (1, 2) if env_index is not None else (self.world.batch_dim, 2)
        pos = torch.zeros(shape, device=self.world.device).uniform_(-1, 1)
        self.world.agents[0].set_pos(pos, batch_index=env_index)
        if env_index is None:
            self.t[:] = 0
        else:
            self.t[env_index] = 0

    def observation(self, agent: Agent) -> torch.Tensor:
        return torch.cat([agent.state.pos, self.t.unsqueeze(-1)], dim=-1)

    def reward(self, agent: Agent) -> torch.Tensor:
        return -agent.state.pos.norm(dim=-1)

    def post_step(self) -> None:
        self.t += 1

    def done(self) -> torch.Tensor:
        return self.t >= self.limit


def play(env: VmasEnv, steps: int, seed: int, action_seed: int = 0) -> list:
    """Reset with ``seed`` and take ``steps`` random steps; every step's outputs."""
    gen = torch.Generator(device=env.device).manual_seed(action_seed)
    out = [env.reset(seed=seed)]
    for _ in range(steps):
        out.append(env.step(random_actions(env, out[-1], gen)))
    return out


def tensor_contents(env: VmasEnv, rows: torch.Tensor) -> dict:
    """``(holder type, key, shape) -> (sorted bytes of the tensors' rows ``rows``, sorted bytes
    of the whole tensors)`` over the scenario's tensors with an env axis. Sorted, because the
    walk reaches objects in an order that can depend on the episode (ball_passage keeps its
    passages in a random order)."""
    found: dict = {}
    for holder, key, value in _MaskedReset(env.vmas_env, env.num_envs, "")._locations().values():
        # Keys are attribute names, list indices or (in the world's dicts) entities.
        label = (type(holder).__name__, str(getattr(key, "name", key)), tuple(value.shape))
        axis = list(value.shape).index(env.num_envs)
        kept = value.index_select(axis, rows).cpu().numpy().tobytes()
        found.setdefault(label, ([], []))
        found[label][0].append(kept)
        found[label][1].append(value.cpu().numpy().tobytes())
    return {k: (sorted(a), sorted(b)) for k, (a, b) in found.items()}


def assert_same_steps(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        for g in x.obs:
            torch.testing.assert_close(x.obs[g], y.obs[g], rtol=0, atol=0)
            torch.testing.assert_close(x.reward[g], y.reward[g], rtol=0, atol=0)
        torch.testing.assert_close(x.state, y.state, rtol=0, atol=0)
        assert torch.equal(x.terminated, y.terminated) and torch.equal(x.truncated, y.truncated)


# -- names and specs --------------------------------------------------------------------------
def test_every_vmas_scenario_is_registered() -> None:
    expected = set(vmas.scenarios) | set(vmas.mpe_scenarios) | set(vmas.debug_scenarios)
    registered = {e.name for e in list_envs() if e.name.startswith("vmas/")}
    assert registered == {f"vmas/{n}" for n in expected}
    installed = scenario_names()
    assert set(installed["scenarios"]) == set(vmas.scenarios)
    assert set(installed["mpe"]) == set(vmas.mpe_scenarios)
    assert set(installed["debug"]) == set(vmas.debug_scenarios)
    # The fallback list (registered when VMAS is missing) covers the installed VMAS.
    assert expected <= {n for names in KNOWN_SCENARIOS.values() for n in names}


def test_spec_shapes_and_bounds() -> None:
    env = make("vmas/balance", num_envs=4)
    (name, group), *rest = env.spec.groups.items()
    assert not rest and name == "agents"
    assert group.agents == ("agent_0", "agent_1", "agent_2")
    assert group.obs_shape == (16,) and not group.has_action_mask
    assert group.action.continuous and group.action.low == (-1.0, -1.0)
    assert group.action.high == (1.0, 1.0)
    assert env.spec.state_shape == (48,) and env.spec.episode_limit == 100
    assert spec_from_dict(spec_to_dict(env.spec)) == env.spec
    # u_range of the scenario; scenario kwargs reach VMAS; BenchMARL's episode limits.
    give_way = make("vmas/give_way").spec.groups["agents"].action
    assert give_way.low == (-0.5, -0.5) and give_way.high == (0.5, 0.5)
    nav = make("vmas/navigation", n_agents=2, max_steps=50).spec
    assert nav.groups["agents"].num_agents == 2 and nav.episode_limit == 50
    assert make("vmas/passage").spec.episode_limit == 500
    # A speaking agent's box: physical [-u, u] then message components in [0, 1].
    crypto = make("vmas/simple_crypto").spec.groups["bob_alice"].action
    assert crypto.low == (-1.0, -1.0, 0.0, 0.0, 0.0, 0.0) and crypto.high == (1.0,) * 6


def test_discrete_and_multidiscrete_actions() -> None:
    flat = make("vmas/balance", continuous_actions=False).spec.groups["agents"].action
    assert flat.nvec == (9,) and flat.dtype == torch.int64
    multi = make("vmas/balance", continuous_actions=False, multidiscrete_actions=True)
    assert multi.spec.groups["agents"].action.nvec == (3, 3)
    for env in (make("vmas/balance", num_envs=3, continuous_actions=False), multi):
        steps = play(env, 5, seed=0)
        assert steps[-1].obs["agents"].shape == (env.num_envs, 3, 16)
    with pytest.raises(EnvError, match="needs continuous_actions=False"):
        make("vmas/balance", multidiscrete_actions=True)


def test_heterogeneous_agents_form_several_groups() -> None:
    env = make("vmas/simple_world_comm", num_envs=2)
    assert {g: s.agents for g, s in env.spec.groups.items()} == {
        "lead_adversaries": ("lead_adversary_0",),
        "adversaries": ("adversary_1", "adversary_2", "adversary_3"),
        "agents": ("agent_0", "agent_1"),
    }
    steps = play(env, 3, seed=0)
    obs = steps[-1].obs
    # The state joins every agent's observation in VMAS's agent order.
    joined = torch.cat([obs[g].flatten(1) for g in env.spec.groups], dim=1)
    torch.testing.assert_close(steps[-1].state, joined)
    assert env.spec.state_shape == (60 + 3 * 60 + 2 * 56,)
    assert set(make("vmas/diff_drive").spec.groups) == {"diff_drives", "holo_rots"}
    # Groups given by hand (here: every agent alone) and their checks.
    own = {"bob": ["bob_0"], "alice": ["alice_0"], "eve": ["eve_0"]}
    assert list(make("vmas/simple_crypto", groups=own).spec.groups) == ["bob", "alice", "eve"]
    with pytest.raises(EnvError, match="mixes 'eve_0'"):
        make("vmas/simple_crypto", groups={"all": ["eve_0", "bob_0", "alice_0"]})
    with pytest.raises(EnvError, match=r"agents \['eve_0'\] are in no group"):
        make("vmas/simple_crypto", groups={"bob": ["bob_0"], "alice": ["alice_0"]})


def test_parameters_are_checked() -> None:
    torch_state = torch.get_rng_state()
    with pytest.raises(EnvError, match="n_agnets.*passed but not used"):
        make("vmas/navigation", n_agnets=3)
    with pytest.raises(EnvError, match="VMAS rejected the scenario parameters"):
        make("vmas/navigation", agents_with_same_goal=9)
    # a bare assert is named by its source line, which says what it checks
    with pytest.raises(EnvError, match="AssertionError at `assert self.n_agents > 1`"):
        make("vmas/balance", n_agents=0)
    assert torch.equal(torch.get_rng_state(), torch_state)  # a failed make leaves it alone
    with pytest.raises(EnvError, match="max_steps must be an integer >= 1"):
        make("vmas/balance", max_steps=0)
    env = make("vmas/balance", num_envs=2)
    env.reset(seed=0)
    with pytest.raises(ActionError, match="outside the box"):
        env.step({"agents": torch.full((2, 3, 2), 1.5)})
    with pytest.raises(ActionError, match="expected a floating dtype"):
        env.step({"agents": torch.zeros(2, 3, 2, dtype=torch.long)})


def test_state_cannot_be_saved() -> None:
    env = make("vmas/balance")
    with pytest.raises(NotImplementedError, match="no snapshot API"):
        env.get_state()
    with pytest.raises(NotImplementedError, match="starts fresh episodes"):
        env.set_state({})


# -- stepping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("continuous", [True, False])
def test_steps_match_vmas_stepped_directly(continuous: bool) -> None:
    """Our reset(seed) is VMAS's reset(seed=seed) and our steps hand VMAS's outputs through."""
    env = VmasEnv("navigation", num_envs=5, continuous_actions=continuous, max_steps=1000)
    direct = vmas.make_env(
        "navigation",
        num_envs=5,
        continuous_actions=continuous,
        terminated_truncated=True,
        max_steps=1000,
    )
    ours = env.reset(seed=7)
    obs = direct.reset(seed=7)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        torch.testing.assert_close(ours.obs["agents"], torch.stack(obs, dim=1), rtol=0, atol=0)
        actions = random_actions(env, ours, gen)
        ours = env.step(actions)
        obs, rewards, terminated, truncated, _ = direct.step(
            [actions["agents"][:, i] for i in range(4)]
        )
        torch.testing.assert_close(ours.reward["agents"], torch.stack(rewards, dim=1))
        assert torch.equal(ours.terminated, terminated) and not ours.truncated.any()


@pytest.mark.parametrize("batched_reset", [True, False])
def test_terminated_truncated_and_auto_reset(batched_reset: bool) -> None:
    # Env i terminates after 2 + i % 3 steps; the time limit is 3 steps.
    env = VmasEnv(Countdown(), num_envs=6, max_steps=3, batched_reset=batched_reset)
    assert (env._masked_reset is not None) == batched_reset
    assert list(env.spec.groups) == ["robots"]
    step = env.reset(seed=0)
    clock = torch.zeros(6)
    for _ in range(7):
        step = env.step({"robots": torch.zeros(6, 1, 2)})
        clock += 1
        limit = torch.arange(6) % 3 + 2
        terminated = clock >= limit
        truncated = (clock >= 3) & ~terminated
        assert torch.equal(step.terminated, terminated)
        assert torch.equal(step.truncated, truncated)
        done = terminated | truncated
        # The final observation is the one the episode ended on; obs starts the next episode.
        assert torch.equal(step.final_obs["robots"][:, 0, 2], clock)
        assert torch.equal(step.obs["robots"][:, 0, 2], torch.where(done, 0.0, clock))
        kept = ~done
        assert torch.equal(step.obs["robots"][kept], step.final_obs["robots"][kept])
        assert torch.equal(step.final_state, step.final_obs["robots"].flatten(1))
        assert torch.equal(step.state, step.obs["robots"].flatten(1))
        # The agents do not move (zero actions): a reset env has a new position.
        moved = (step.obs["robots"][:, 0, :2] != step.final_obs["robots"][:, 0, :2]).any(-1)
        assert torch.equal(moved, done)
        clock = torch.where(done, 0.0, clock)
        assert step.alive["robots"].all() and step.stats == {}


def test_batched_reset_leaves_unfinished_envs_exactly_as_they_were() -> None:
    """For every scenario of BATCHED_RESET_SCENARIOS: after resetting some envs in one batch, each
    tensor of the scenario holds, in the other envs' rows, what a twin env that reset nothing
    holds; the reset envs start new episodes."""
    e = 7
    done = torch.zeros(e, dtype=torch.bool)
    done[[0, 3, 6]] = True
    for name in sorted(BATCHED_RESET_SCENARIOS):
        env, twin = (VmasEnv(name, num_envs=e, max_steps=1000) for _ in range(2))
        assert env._masked_reset is not None, (name, env.batched_reset_off_reason)
        gen = torch.Generator().manual_seed(1)
        first = env.reset(seed=3)
        twin.reset(seed=3)
        for _ in range(3):
            actions = random_actions(env, first, gen)
            for x in (env, twin):
                with x.vmas_random_state():
                    x.vmas_env.step([actions[g][:, k] for g, k in x._slots])
        with env.vmas_random_state():
            env._masked_reset.reset(done)
        assert torch.equal(env.vmas_env.steps, torch.where(done, 0.0, 3.0)), name
        keep = (~done).nonzero().flatten()
        mine, theirs = tensor_contents(env, keep), tensor_contents(twin, keep)
        # A reset may empty a cache that the next step refills (football's AI clears its
        # displacement cache, a dict, on every reset, reset_at included); nothing else goes.
        dropped = theirs.keys() - mine.keys()
        assert all(holder == "dict" for holder, *_ in dropped) and not mine.keys() - theirs.keys()
        changed = False
        for label in mine:
            kept_a, whole_a = mine[label]
            kept_b, whole_b = theirs[label]
            assert kept_a == kept_b, (name, label)
            changed |= whole_a != whole_b
        assert changed, f"{name}: the batched reset reset nothing"


def test_batched_reset_keeps_trajectories() -> None:
    """After a batched partial reset the unfinished envs go on exactly as in a twin env."""
    for name in ("balance", "navigation"):
        env, twin = (VmasEnv(name, num_envs=40, max_steps=1000) for _ in range(2))
        first = env.reset(seed=0)
        twin.reset(seed=0)
        gen = torch.Generator().manual_seed(2)
        done = torch.arange(40) % 4 == 1
        for t in range(6):
            if t == 3:
                with env.vmas_random_state():
                    env._masked_reset.reset(done)
                env._rng.states = list(twin._rng.states)  # same random numbers from here on
            actions = random_actions(env, first, gen)
            outs = []
            for x in (env, twin):
                with x.vmas_random_state():
                    outs.append(x.vmas_env.step([actions[g][:, k] for g, k in x._slots]))
            (obs_a, rew_a, *_), (obs_b, rew_b, *_) = outs
            for a, b in zip(obs_a + rew_a, obs_b + rew_b, strict=True):
                assert torch.equal(a[~done], b[~done]), (name, t)


def test_finished_envs_are_reset_in_one_batch() -> None:
    """balance with random actions drops its package now and then: the finished envs of a step
    are reset together, with one batched reset."""
    env = make("vmas/balance", num_envs=64)
    calls = []
    batched = env._masked_reset.reset
    env._masked_reset.reset = lambda done: calls.append(int(done.sum())) or batched(done)
    steps = play(env, 60, seed=0)
    finished = [int(s.done.sum()) for s in steps[1:]]
    assert calls == [n for n in finished if n] and max(calls) > 1
    assert not any(s.truncated.any() for s in steps[1:])
    for s in steps[1:]:
        moved = (s.obs["agents"] != s.final_obs["agents"]).flatten(1).any(-1)
        assert torch.equal(moved, s.done)


# -- random numbers ---------------------------------------------------------------------------
def test_seeding_is_reproducible_and_private() -> None:
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    py_state = random.getstate()

    def balance() -> VmasEnv:
        return make("vmas/balance", num_envs=64, seed=5, max_steps=50)

    a = play(balance(), 60, seed=5)
    # Terminations reset a few envs, the time limit most of them: both are replayed.
    finished = [int(s.done.sum()) for s in a[1:]]
    assert max(finished) > 32 and sum(0 < n < 32 for n in finished) > 3
    # A new env and reset(seed) replay the same episodes...
    fresh = balance()
    gen = torch.Generator().manual_seed(0)
    b = [fresh.reset()]
    for _ in range(60):
        b.append(fresh.step(random_actions(fresh, b[-1], gen)))
    assert_same_steps(a, b)
    # ...another env stepped in between does not change them...
    env, other = balance(), balance()
    gen, other_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    c = [env.reset(seed=5)]
    other_step = other.reset(seed=9)
    for _ in range(60):
        other_step = other.step(random_actions(other, other_step, other_gen))
        c.append(env.step(random_actions(env, c[-1], gen)))
    assert_same_steps(a, c)
    # ...another seed gives other episodes, and the caller's RNGs are untouched.
    d = play(balance(), 0, seed=6)
    assert not torch.equal(a[0].obs["agents"], d[0].obs["agents"])
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert str(np.random.get_state()) == str(np_state) and random.getstate() == py_state


def test_envs_of_a_batch_are_independent() -> None:
    """VMAS draws the random numbers of all envs in one call, so env i of a batch does not replay
    a one-env run with the same seed. What holds: an env's trajectory does not depend on the
    other envs' actions."""
    a, b = (make("vmas/navigation", num_envs=6, max_steps=1000) for _ in range(2))
    sa, sb = a.reset(seed=1), b.reset(seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        actions = random_actions(a, sa, gen)["agents"]
        other = actions.clone()
        other[0] = -other[0]
        sa, sb = a.step({"agents": actions}), b.step({"agents": other})
        assert torch.equal(sa.obs["agents"][1:], sb.obs["agents"][1:])
        assert not torch.equal(sa.obs["agents"][0], sb.obs["agents"][0])
    single = play(make("vmas/navigation", num_envs=1), 5, seed=1)
    assert single[-1].obs["agents"].shape == (1, 4, 18)


# -- PettingZoo view, rendering, missing package ----------------------------------------------
def test_pettingzoo_view_discrete() -> None:
    pytest.importorskip("pettingzoo")
    from pettingzoo.test import parallel_api_test

    from mappo.envs.pettingzoo_view import PettingZooView

    parallel_api_test(PettingZooView("vmas/balance", continuous_actions=False, seed=1), 30)


def test_pettingzoo_view_continuous() -> None:
    pytest.importorskip("pettingzoo")
    from gymnasium import spaces
    from pettingzoo.test import parallel_api_test

    from mappo.envs.pettingzoo_view import PettingZooView

    view = PettingZooView("vmas/balance", seed=1)
    assert view.action_space("agent_0") == spaces.Box(-1.0, 1.0, (2,), np.float32)
    parallel_api_test(view, 30)


def test_render() -> None:
    env = make("vmas/give_way", num_envs=2)  # a wide (1600 x 700) view: letterboxed
    env.reset(seed=0)
    # Off-screen through EGL (Debian's libegl1, present on the project's machines).
    frame = env.render(1, size=200)
    assert frame.shape == (200, 200, 3) and frame.dtype == np.uint8
    assert frame.std() > 0
    with pytest.raises(EnvError, match="out of range"):
        env.render(2)
    env.close()


def test_missing_vmas_gives_one_line_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "vmas/balance" in {e.name for e in list_envs()}
    monkeypatch.setitem(sys.modules, "vmas", None)  # import vmas -> ModuleNotFoundError
    with pytest.raises(EnvError) as err:
        make("vmas/balance", num_envs=2)
    message = str(err.value)
    assert "pip install 'mappo[vmas]'" in message and "\n" not in message
    # Without VMAS the names come from the list of VMAS 1.5.2's scenarios.
    assert scenario_names() == KNOWN_SCENARIOS


def test_forced_batched_reset_is_refused_where_the_snapshot_cannot_cover_the_state() -> None:
    # sampling's batched reset builds new distributions with an env axis.
    with pytest.warns(UserWarning, match="batched_reset=True refused"):
        env = make("vmas/sampling", num_envs=4, batched_reset=True)
    assert env._masked_reset is None and "MultivariateNormal" in env.batched_reset_off_reason
    assert make("vmas/balance", num_envs=4, batched_reset=False)._masked_reset is None
    play(env, 3, seed=0)


def test_a_vmas_preset_trains_evaluates_and_renders(tmp_path) -> None:
    """The path a user takes: `mappo train vmas/balance`, then eval with a GIF, from the CLI."""
    import json
    import subprocess

    run_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "mappo.cli"]
    out = subprocess.run(
        [
            *cmd,
            "train",
            "vmas/balance",
            "env.num_envs=4",
            "total_env_steps=800",
            "eval_episodes=2",
            "progress=false",
            "threads=1",
            f"run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "eval_return_mean" in out.stdout
    (run,) = run_dir.glob("vmas/balance/mappo/*_seed1")
    gif = tmp_path / "balance.gif"
    out = subprocess.run(
        [*cmd, "eval", str(run), "--episodes", "2", "--gif", str(gif), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert math.isfinite(json.loads(out.stdout)["eval_return_mean"])
    assert gif.stat().st_size > 1000


def test_a_scenario_whose_physics_turn_nan_is_one_line() -> None:
    """balance with a package of mass 0 gives NaN observations after its first step, and VMAS
    asserts on the NaN actions the policy computes from them (a traceback); it is an EnvError
    naming the cause and the scenario's parameters."""
    env = make("vmas/balance", num_envs=2, package_mass=0)
    env.reset(seed=0)
    shapes = {g: (2, s.num_agents, s.action.total) for g, s in env.spec.groups.items()}
    nan_actions = {g: torch.full(shape, float("nan")) for g, shape in shapes.items()}
    with pytest.raises(ActionError, match="is not finite; check the policy's outputs for NaN"):
        env.step(nan_actions)  # the checks of the env contract, on by default
    env.validate_actions = False  # (as in training, where the policy's actions are trusted)
    with pytest.raises(EnvError) as info:
        env.step(nan_actions)
    assert str(info.value).startswith(
        "vmas/balance: VMAS's step() raised AssertionError on actions holding NaN or inf, "
        "computed from observations that held them; check the scenario's parameters "
        "(env.kwargs: "
    )
    assert "package_mass=0)" in str(info.value)


def test_seeds_of_64_bits_reset_reproducibly() -> None:
    """The episode collections of the value family, COMA and MADDPG reset with 64-bit seeds
    (numpy's legacy RandomState, which VMAS seeds, takes 32); distinct seeds stay distinct."""
    from mappo.episodes import collection_seed

    env = make("vmas/balance", num_envs=4, seed=0, max_steps=50)
    big = collection_seed(1, 0)
    assert big >= 2**32
    first = env.reset(seed=big).obs
    again = env.reset(seed=big).obs
    other = env.reset(seed=collection_seed(2, 0)).obs
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
        assert not torch.equal(first[name], other[name])


def test_maddpg_trains_on_vmas_with_any_seed(tmp_path) -> None:
    from mappo.trainer import train

    over = {"env.name": "vmas/balance", "env.num_envs": 4, "env.kwargs": {"max_steps": 10}}
    over |= {"total_env_steps": 4 * 10 * 3, "algo.batch_size": 4, "algo.buffer_size": 16}
    over |= {"eval_episodes": 2, "progress": False, "threads": 1, "seed": 3}
    run = train("mpe/simple_spread_maddpg", {**over, "run_dir": str(tmp_path)})
    assert math.isfinite(run.summary["eval_return_mean"])
