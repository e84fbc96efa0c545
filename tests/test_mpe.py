"""The batched particle environments: specs, batching, auto-reset, seeding, state injection,
reward conventions and input checks. Reference trajectories are in test_mpe_fixtures.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mappo.envs import (
    ActionError,
    ActionSpec,
    BatchedEnv,
    EnvError,
    EnvSpec,
    EnvStep,
    GroupSpec,
    list_envs,
    make,
)
from mappo.envs.mpe import ParticleEnv, WorldSpec
from mappo.envs.rendering import random_actions

NAMES = ("mpe/simple_spread", "mpe/simple_speaker_listener", "mpe/simple_reference")


def _actions(env: BatchedEnv, seed: int, steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    dummy = EnvStep({}, torch.empty(0), {}, torch.empty(0), torch.empty(0), {})
    return [random_actions(env, dummy, gen) for _ in range(steps)]


def _rollout(env: BatchedEnv, actions: list[dict[str, torch.Tensor]]) -> list[EnvStep]:
    return [env.step(a) for a in actions]


def _cluster_state(env: BatchedEnv, spread: float = 0.12) -> dict[str, torch.Tensor]:
    """Every env's agents within ``spread`` of the origin, so that contacts happen at once."""
    state = env.get_state()
    gen = torch.Generator().manual_seed(7)
    state["agent_pos"] = (torch.rand(state["agent_pos"].shape, generator=gen) * 2 - 1) * spread
    return state


# -- registry and specs ----------------------------------------------------------------------
def test_names_are_registered() -> None:
    names = {e.name for e in list_envs()}
    assert set(NAMES) <= names


def test_spread_spec() -> None:
    env = make("mpe/simple_spread", num_envs=4)
    group = env.spec.groups["agents"]
    assert group.agents == ("agent_0", "agent_1", "agent_2")
    assert group.obs_shape == (18,) and group.action.nvec == (5,)
    assert env.spec.state_shape == (54,) and env.spec.episode_limit == 25
    assert env.spec.stat_names == ("occupied_landmarks", "collisions", "sum_min_dist")
    step = env.reset(seed=0)
    assert step.obs["agents"].shape == (4, 3, 18) and step.obs["agents"].dtype == torch.float32
    assert step.state.shape == (4, 54)
    assert step.reward["agents"].shape == (4, 3)
    assert step.alive["agents"].all() and step.action_mask == {}
    # The global state is the agents' observations concatenated in agent order.
    torch.testing.assert_close(step.state, step.obs["agents"].reshape(4, 54))


@pytest.mark.parametrize("n,m", [(1, 0), (2, 5), (4, 2), (6, 6)])
def test_spread_any_number_of_agents_and_landmarks(n: int, m: int) -> None:
    env = make("mpe/simple_spread", num_envs=3, num_agents=n, num_landmarks=m)
    dim = 4 + 2 * m + 4 * (n - 1)
    assert env.spec.groups["agents"].obs_shape == (dim,)
    out = env.reset(seed=1)
    for a in _actions(env, 0, 30):
        out = env.step(a)
        assert out.obs["agents"].shape == (3, n, dim)
        assert (
            torch.isfinite(out.obs["agents"]).all() and torch.isfinite(out.reward["agents"]).all()
        )
    # Observation layout: [vel, pos, landmark - pos, other - pos, other comm].
    state = env.get_state()
    obs = out.obs["agents"]
    torch.testing.assert_close(obs[..., 2:4], state["agent_pos"])
    rel = state["landmark_pos"].unsqueeze(1) - state["agent_pos"].unsqueeze(2)
    torch.testing.assert_close(obs[..., 4 : 4 + 2 * m], rel.reshape(3, n, 2 * m))


def test_speaker_listener_spec_and_message_same_step() -> None:
    env = make("mpe/simple_speaker_listener", num_envs=3)
    assert env.spec.groups["speaker"].agents == ("speaker_0",)
    assert env.spec.groups["listener"].agents == ("listener_0",)
    assert env.spec.groups["speaker"].obs_shape == (3,)
    assert env.spec.groups["listener"].obs_shape == (11,)
    assert env.spec.state_shape == (14,)
    start = env.reset(seed=0)
    speaker_pos = env.get_state()["agent_pos"][:, 0].clone()
    for a in _actions(env, 1, 10):
        out = env.step(a)
        # The listener hears the message sent in this very step, as a one-hot.
        heard = out.obs["listener"][:, 0, 8:11]
        torch.testing.assert_close(heard.argmax(-1), a["speaker"][:, 0, 0])
        assert torch.equal(heard.sum(-1), torch.ones(3))
        torch.testing.assert_close(
            out.state, torch.cat([out.obs["speaker"], out.obs["listener"]], -1).squeeze(1)
        )
        torch.testing.assert_close(out.reward["speaker"], out.reward["listener"])
    # The speaker cannot move.
    torch.testing.assert_close(env.get_state()["agent_pos"][:, 0], speaker_pos)
    assert start.obs["listener"][:, 0, 8:11].abs().sum() == 0


def test_reference_spec_and_messages() -> None:
    env = make("mpe/simple_reference", num_envs=3)
    group = env.spec.groups["agents"]
    assert group.action.nvec == (5, 10) and group.obs_shape == (21,)
    assert env.spec.state_shape == (42,)
    env.reset(seed=0)
    for a in _actions(env, 2, 5):
        out = env.step(a)
        # Agent i hears the other agent's message of this step.
        heard = out.obs["agents"][..., 11:].argmax(-1)
        torch.testing.assert_close(heard, a["agents"][:, [1, 0], 1])
        # Shared reward: both agents get the same sum.
        torch.testing.assert_close(out.reward["agents"][:, 0], out.reward["agents"][:, 1])


# -- batching, auto-reset, seeding -----------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_env_k_of_a_batch_equals_a_single_env(name: str) -> None:
    batch = make(name, num_envs=5, seed=3)
    batch.reset()
    if name == "mpe/simple_spread":
        batch.set_state(_cluster_state(batch))
    start = batch.get_state()
    actions = _actions(batch, 4, 25)
    outs = _rollout(batch, actions)
    for k in (0, 3):
        single = make(name, num_envs=1, seed=99)
        single.set_state({key: v[k : k + 1] for key, v in start.items()})
        for t, a in enumerate(actions):
            one = single.step({g: x[k : k + 1] for g, x in a.items()})
            for g in one.final_obs:
                assert torch.equal(one.final_obs[g][0], outs[t].final_obs[g][k]), (t, g)
                assert torch.equal(one.reward[g][0], outs[t].reward[g][k]), (t, g)
            assert bool(one.truncated[0]) == bool(outs[t].truncated[k])


@pytest.mark.parametrize("name", NAMES)
def test_auto_reset_at_the_time_limit(name: str) -> None:
    env = make(name, num_envs=4)
    env.reset(seed=5)
    outs = _rollout(env, _actions(env, 5, 25))
    for out in outs[:-1]:
        assert not out.done.any()
        for g in out.obs:
            assert torch.equal(out.final_obs[g], out.obs[g])
    last = outs[-1]
    assert last.truncated.all() and not last.terminated.any()
    state = env.get_state()
    assert torch.equal(state["step"], torch.zeros(4, dtype=torch.int64))
    assert torch.equal(state["agent_vel"], torch.zeros_like(state["agent_vel"]))
    for g in last.obs:
        # obs is the new episode's first observation, final_obs the one the old episode ended on.
        assert not torch.equal(last.final_obs[g], last.obs[g])
    assert not torch.equal(last.final_state, last.state)
    assert set(last.stats) == set(env.spec.stat_names)
    for v in last.stats.values():
        assert v.shape == (4,) and v.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_time_feature_is_the_fraction_of_the_episode_elapsed(name: str) -> None:
    """With ``time_feature`` every observation and the state end with ``step / episode_length``
    (0 at an episode's start, 1 on the final observation at the limit, 0 again after the
    reset); everything before it is what the env without the feature returns."""
    plain = make(name, num_envs=3, episode_length=5)
    timed = make(name, num_envs=3, episode_length=5, time_feature=True)
    for g, spec in timed.spec.groups.items():
        assert spec.obs_shape == (plain.spec.groups[g].obs_shape[0] + 1,)
    assert timed.spec.state_shape == (plain.spec.state_shape[0] + 1,)
    plain.reset(seed=2)
    timed.reset(seed=2)
    # Envs 0-2 stand at steps 0, 2 and 4 of their episodes: each reaches the limit on its own step.
    plain.set_state({"step": torch.tensor([0, 2, 4])})
    first = timed.set_state({"step": torch.tensor([0, 2, 4])})
    for o in first.obs.values():
        assert torch.equal(o[..., -1], torch.tensor([0.0, 0.4, 0.8])[:, None].expand_as(o[..., -1]))
    timed_outs = _rollout(timed, _actions(timed, 3, 7))
    outs = list(zip(timed_outs, _rollout(plain, _actions(plain, 3, 7)), strict=True))
    steps = torch.tensor([0, 2, 4])
    for out, ref in outs:
        steps = steps + 1
        final = steps / 5.0
        steps = torch.where(steps >= 5, torch.zeros_like(steps), steps)
        assert torch.equal(out.truncated, ref.truncated)
        for g in out.obs:
            assert torch.equal(out.obs[g][..., :-1], ref.obs[g])
            assert torch.equal(out.final_obs[g][..., :-1], ref.final_obs[g])
            assert torch.allclose(
                out.obs[g][..., -1], (steps / 5.0)[:, None].expand(-1, out.obs[g].shape[1])
            )
            assert torch.allclose(
                out.final_obs[g][..., -1], final[:, None].expand(-1, out.obs[g].shape[1])
            )
        assert torch.equal(out.state[:, :-1], ref.state)
        assert torch.allclose(out.state[:, -1], steps / 5.0)
        assert torch.allclose(out.final_state[:, -1], final)
    with pytest.raises(EnvError, match="time_feature must be true or false"):
        make(name, num_envs=1, time_feature="yes")


def test_spread_stats_match_the_observations() -> None:
    env = make("mpe/simple_spread", num_envs=6)
    env.reset(seed=2)
    env.set_state(_cluster_state(env, spread=0.3))
    collisions = torch.zeros(6)
    for a in _actions(env, 3, 25):
        out = env.step(a)
        obs = out.final_obs["agents"]  # [E, 3, 18]
        other = obs[..., 10:14].reshape(6, 3, 2, 2).norm(dim=-1)  # [E, agent, other]
        collisions += (other < 0.3).sum((1, 2)) / 2
    assert collisions.sum() > 0, "the cluster start must produce collisions"
    lm_dist = obs[..., 4:10].reshape(6, 3, 3, 2).norm(dim=-1).amin(1)  # [E, landmark]
    torch.testing.assert_close(out.stats["collisions"], collisions)
    torch.testing.assert_close(out.stats["sum_min_dist"], lm_dist.sum(-1))
    torch.testing.assert_close(out.stats["occupied_landmarks"], (lm_dist < 0.1).sum(-1).float())
    # The next episode's collision count starts from zero.
    assert torch.equal(env.get_state()["episode_collisions"], torch.zeros(6))


def test_out_of_phase_envs_reset_on_their_own_step() -> None:
    env = make("mpe/simple_spread", num_envs=4)
    env.reset(seed=0)
    env.set_state({"step": torch.tensor([20, 3])}, env_ids=torch.tensor([1, 2]))
    ends = {k: [] for k in range(4)}
    for t, a in enumerate(_actions(env, 0, 50), start=1):
        out = env.step(a)
        for k in range(4):
            if out.truncated[k]:
                ends[k].append(t)
                assert torch.equal(out.obs["agents"][k, :, 0:2], torch.zeros(3, 2))
    assert ends == {0: [25, 50], 1: [5, 30], 2: [22, 47], 3: [25, 50]}
    assert env.get_state()["step"].tolist() == [0, 20, 3, 0]


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_replays_and_different_seeds_differ(name: str) -> None:
    def run(seed: int) -> torch.Tensor:
        env = make(name, num_envs=3)
        first = env.reset(seed=seed)
        obs = [first.state]
        for a in _actions(env, 0, 60):  # crosses two auto-resets
            obs.append(env.step(a).state)
        return torch.stack(obs)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    # The env's first episode without an explicit reset seed is that of its constructor seed.
    assert torch.equal(make(name, num_envs=3, seed=4).reset().state, run(4)[0])


def test_torch_global_rng_is_untouched() -> None:
    before = torch.random.get_rng_state()
    env = make("mpe/simple_reference", num_envs=2)
    env.reset(seed=1)
    for a in _actions(env, 0, 30):
        env.step(a)
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("name", NAMES)
def test_get_state_set_state_round_trip(name: str) -> None:
    env = make(name, num_envs=3)
    env.reset(seed=0)
    actions = _actions(env, 1, 40)
    _rollout(env, actions[:7])
    saved = env.get_state()
    # Episodes after the next auto-reset come from the env's generator: save it too.
    rng = env.generator.get_state()
    first = _rollout(env, actions[7:])
    env.reset(seed=123)
    restored = env.set_state(saved)
    env.generator.set_state(rng)
    assert restored.final_obs is None and not restored.done.any()
    second = _rollout(env, actions[7:])
    for a, b in zip(first, second, strict=True):
        for g in a.obs:
            assert torch.equal(a.final_obs[g], b.final_obs[g])
            assert torch.equal(a.reward[g], b.reward[g])
        assert torch.equal(a.truncated, b.truncated)


# -- rewards ---------------------------------------------------------------------------------
def test_pettingzoo_reward_convention() -> None:
    n = 3
    paper = make("mpe/simple_spread", num_envs=8)
    pz = make("mpe/simple_spread", num_envs=8, reward="pettingzoo")
    paper.reset(seed=0)
    start = _cluster_state(paper, spread=0.25)
    paper.set_state(start)
    pz.set_state(start)
    pure_global = make("mpe/simple_spread", num_envs=8, reward="pettingzoo", local_ratio=0.0)
    pure_global.set_state(start)
    collided = False
    for a in _actions(paper, 6, 20):
        p, z, g = paper.step(a), pz.step(a), pure_global.step(a)
        # Same trajectory, only the reward differs.
        assert torch.equal(p.obs["agents"], z.obs["agents"])
        local = (z.reward["agents"] - 0.5 * g.reward["agents"]) / 0.5  # -(collisions with others)
        collided |= bool((local < 0).any())
        # global: -sum_l min_a dist, the same for every agent.
        torch.testing.assert_close(g.reward["agents"], g.reward["agents"][:, :1].expand(-1, n))
        # The paper sums over agents (global + local - 1): the -1 is the self-collision.
        expected = n * g.reward["agents"][:, 0] + local.sum(1) - n
        torch.testing.assert_close(p.reward["agents"][:, 0], expected)
        # With local_ratio 0.5: paper = 2 * sum_i pettingzoo_i - N.
        torch.testing.assert_close(p.reward["agents"][:, 0], 2 * z.reward["agents"].sum(1) - n)
    assert collided, "the cluster start must make agents collide"


# -- bad inputs ------------------------------------------------------------------------------
def test_bad_action_batches_raise() -> None:
    env = make("mpe/simple_spread", num_envs=2)
    env.reset()
    good = torch.zeros(2, 3, 1, dtype=torch.int64)
    with pytest.raises(ActionError, match="shape"):
        env.step({"agents": torch.zeros(2, 2, 1, dtype=torch.int64)})
    with pytest.raises(ActionError, match="dtype"):
        env.step({"agents": good.float()})
    with pytest.raises(ActionError, match="out of range"):
        env.step({"agents": good + 5})
    with pytest.raises(ActionError, match="groups"):
        env.step({"speaker": good})
    # (a dict nested by mistake, ragged lists: numpy cannot make an array of them)
    with pytest.raises(ActionError, match=r"'agents' must be a tensor or array of shape \(2, 3\)"):
        env.step({"agents": {"agents": good}})
    with pytest.raises(ActionError, match="not one"):
        env.step({"agents": [[0, 1, 2], [0, 1]]})
    ref = make("mpe/simple_reference", num_envs=2)
    with pytest.raises(ActionError, match="out of range"):
        ref.step({"agents": torch.tensor([[[0, 10], [0, 0]]] * 2)})


def test_unknown_env_name_raises() -> None:
    with pytest.raises(EnvError, match="unknown environment 'mpe/nope'"):
        make("mpe/nope")
    with pytest.raises(EnvError, match="did you mean 'mpe/simple_spread'"):
        make("mpe/simple_sprad")


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("mpe/simple_spread", {"num_agents": 0}, "num_agents must be an integer >= 1"),
        ("mpe/simple_spread", {"num_agents": 2.5}, "num_agents must be an integer >= 1"),
        ("mpe/simple_spread", {"num_landmarks": -1}, "num_landmarks must be an integer >= 0"),
        (
            "mpe/simple_spread",
            {"reward": "dense"},
            r"reward must be one of \['paper', 'pettingzoo'\]",
        ),
        (
            "mpe/simple_spread",
            {"reward": "pettingzoo", "local_ratio": 1.5},
            r"local_ratio must be a number in \[0, 1\]",
        ),
        (
            "mpe/simple_spread",
            {"local_ratio": 0.3},
            "local_ratio applies only to reward='pettingzoo'",
        ),
        ("mpe/simple_spread", {"episode_length": 0}, "episode_length must be an integer >= 1"),
        (
            "mpe/simple_spread",
            {"num_agent": 4},
            "unknown parameter 'num_agent'; did you mean 'num_agents'",
        ),
        ("mpe/simple_reference", {"num_agents": 3}, "unknown parameter 'num_agents'"),
        ("mpe/simple_speaker_listener", {"episode_length": -2}, "episode_length"),
        ("mpe/simple_spread", {"num_envs": 0}, "num_envs must be a positive integer"),
    ],
)
def test_bad_scenario_parameters_raise(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(EnvError, match=match):
        make(name, **kwargs)


def test_bad_set_state_raises() -> None:
    env = make("mpe/simple_reference", num_envs=3)
    with pytest.raises(EnvError, match="unknown state field"):
        env.set_state({"agent_position": torch.zeros(3, 2, 2)})
    with pytest.raises(EnvError, match=r"expected \(3, 2, 2\)"):
        env.set_state({"agent_pos": torch.zeros(3, 2)})
    with pytest.raises(EnvError, match=r"must lie in \[0, 25\)"):
        env.set_state({"step": torch.tensor([25, 0, 0])})
    with pytest.raises(EnvError, match=r"goal_landmark' must lie in \[0, 3\)"):
        env.set_state({"goal_landmark": torch.tensor([[0, 3]])}, env_ids=torch.tensor([1]))
    with pytest.raises(EnvError, match="env_ids must lie in"):
        env.set_state({"step": torch.tensor([0])}, env_ids=torch.tensor([3]))
    with pytest.raises(EnvError, match="non-finite"):
        env.set_state({"agent_vel": torch.full((3, 2, 2), float("nan"))})


# -- the generic particle physics against a direct transcription of the reference ------------
class _ContactWorld(ParticleEnv):
    """A world with every kind of contact pair: a fixed colliding agent, a non-colliding agent
    and a colliding landmark. Observations are the agent positions."""

    name = "test/contact_world"

    def __init__(self, num_envs: int) -> None:
        super().__init__(num_envs, "cpu", 0)
        self.spec = EnvSpec(
            groups={"agents": GroupSpec(("a0", "a1", "a2"), (2,), ActionSpec((5,)))},
            state_shape=(6,),
            episode_limit=25,
        )
        world = WorldSpec(
            agent_size=(0.15, 0.2, 0.1),
            agent_movable=(True, False, True),
            agent_collide=(True, True, False),
            agent_silent=(True, True, True),
            landmark_size=(0.3, 0.1),
            landmark_collide=(True, False),
            dim_c=2,
        )
        self._init_world(world, 25)

    def _split_actions(self, actions: dict[str, torch.Tensor]) -> tuple:
        return actions["agents"][:, [0, 2], 0], None  # the movable agents' moves

    def _observe(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        pos = self._state["agent_pos"].permute(2, 1, 0).contiguous()
        return {"agents": pos}, pos.reshape(self.num_envs, 6)

    def _reward_and_stats(self) -> tuple[dict, dict]:
        return {"agents": torch.zeros(self.num_envs, 3)}, {}

    def _render_info(self, env_index: int) -> tuple[list, list, list]:
        return [(0.5, 0.5, 0.5)] * 3, [(0.2, 0.2, 0.2)] * 2, []


def _reference_step(pos: np.ndarray, vel: np.ndarray, moves: np.ndarray) -> None:
    """One step of MPE_SPEC's world physics for _ContactWorld, entity by entity (float64)."""
    size = [0.15, 0.2, 0.1, 0.3, 0.1]
    movable = [True, False, True, False, False]
    collide = [True, True, False, True, False]
    push = {0: (0, 0), 1: (1, 0), 2: (-1, 0), 3: (0, 1), 4: (0, -1)}
    force = np.zeros_like(pos)
    for agent, move in zip((0, 2), moves, strict=True):
        force[agent] = 5.0 * np.array(push[int(move)])
    for a in range(5):
        for b in range(a + 1, 5):
            if collide[a] and collide[b] and (movable[a] or movable[b]):
                delta = pos[a] - pos[b]
                dist = np.sqrt(np.sum(delta**2))
                penetration = np.logaddexp(0, -(dist - size[a] - size[b]) / 0.001) * 0.001
                f = 100.0 * delta / dist * penetration
                if movable[a]:
                    force[a] += f
                if movable[b]:
                    force[b] -= f
    for i in range(5):
        if movable[i]:
            vel[i] = vel[i] * 0.75 + force[i] * 0.1
            pos[i] += vel[i] * 0.1


def test_contact_physics_matches_the_reference_transcription() -> None:
    env = _ContactWorld(num_envs=3)
    gen = torch.Generator().manual_seed(0)
    # Crowd everything near the origin so that every kind of pair is in contact.
    agent_pos = (torch.rand(3, 3, 2, generator=gen) - 0.5) * 0.4
    landmark_pos = (torch.rand(3, 2, 2, generator=gen) - 0.5) * 0.4
    env.set_state({"agent_pos": agent_pos, "landmark_pos": landmark_pos})
    pos = torch.cat([agent_pos, landmark_pos], 1).double().numpy()
    vel = np.zeros_like(pos)
    fastest = 0.0
    for _ in range(12):
        moves = torch.randint(0, 5, (3, 3, 1), generator=gen)
        out = env.step({"agents": moves})
        for k in range(3):
            _reference_step(pos[k], vel[k], moves[k, [0, 2], 0].numpy())
        np.testing.assert_allclose(out.obs["agents"].numpy(), pos[:, :3], atol=1e-5)
        fastest = max(fastest, float(np.abs(vel).max()))
    state = env.get_state()
    np.testing.assert_allclose(state["agent_vel"].numpy(), vel[:, :3], atol=1e-4)
    # The fixed agent and the landmarks never move.
    assert torch.equal(state["agent_pos"][:, 1], agent_pos[:, 1])
    assert torch.equal(state["landmark_pos"], landmark_pos)
    # Moves alone never exceed a speed of 5 * 0.1 / 0.25 = 2: contact forces have acted.
    assert fastest > 2.0
