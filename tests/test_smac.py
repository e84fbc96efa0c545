"""The SMAC-style battles: SMAC's interface (sizes, observations, state, masks), combat figures
checked by hand on small injected fights, episode ends and statistics, batching, seeding, errors,
rendering and the PettingZoo view."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pettingzoo.test import parallel_api_test

from mappo.envs import ActionError, EnvError, EnvStep, make
from mappo.envs.pettingzoo_view import PettingZooView
from mappo.envs.rendering import random_actions, record_episode
from mappo.envs.smac import MAPS, SMACEnv, scripted_actions
from mappo.envs.smac.units import loops

# (obs size, state size) of SMAC's own environment for these maps (default options).
SMAC_SIZES = {
    "3m": (30, 48),
    "8m": (80, 168),
    "25m": (250, 950),
    "5m_vs_6m": (55, 98),
    "8m_vs_9m": (85, 179),
    "10m_vs_11m": (105, 243),
    "2m_vs_1z": (16, 26),
    "2s3z": (80, 120),
    "3s5z": (128, 216),
    "3s5z_vs_3s6z": (136, 230),
    "3s_vs_3z": (36, 54),
    "3s_vs_4z": (42, 61),
    "3s_vs_5z": (48, 68),
    "MMM": (160, 290),
    "MMM2": (176, 322),
    "6h_vs_8z": (78, 140),
    "corridor": (156, 282),
}
REQUIRED_MAPS = tuple(SMAC_SIZES)
DOCS = Path(__file__).parent.parent / "docs" / "smac.md"


def _env(name: str, num_envs: int = 1, seed: int = 0, **kwargs: object) -> SMACEnv:
    env = make(f"smac/{name}", num_envs=num_envs, seed=seed, **kwargs)
    assert isinstance(env, SMACEnv)
    return env


# -- a slow, per-agent reference of SMAC's get_obs_agent / get_state / avail actions -------------
def _ref_avail(env: SMACEnv, st: dict[str, torch.Tensor], e: int, i: int) -> list[int]:
    n, m = env.n_agents, env.n_enemies
    pos, health = st["pos"][e].tolist(), st["health"][e].tolist()
    avail = [0] * (6 + m)
    if health[i] <= 0:
        avail[0] = 1
        return avail
    avail[1] = 1
    x, y = pos[i]
    w, h = env.map.size
    avail[2], avail[3] = int(y + 1 < h), int(y - 1 >= 0)
    avail[4], avail[5] = int(x + 1 < w), int(x - 1 >= 0)
    unit = env.units[i]
    for j in range(m):
        if unit.healer:
            if j >= n:
                continue
            t, other = j, env.units[j]
            valid = not other.healer and health[t] < other.health
        else:
            t, other = n + j, env.units[n + j]
            valid = unit.hits_air or not other.air
        d = math.dist(pos[i], pos[t])
        avail[6 + j] = int(valid and health[t] > 0 and d <= 6)
    return avail


def _ref_obs(env: SMACEnv, st: dict[str, torch.Tensor], e: int, i: int) -> list[float]:
    n, m = env.n_agents, env.n_enemies
    pos, health, shield = st["pos"][e].tolist(), st["health"][e].tolist(), st["shield"][e].tolist()
    types = env.map.unit_types
    ally_sh = any(u.shield > 0 for u in env.units[:n])
    enemy_sh = any(u.shield > 0 for u in env.units[n:])

    def unit_feats(u: int, with_shield: bool) -> list[float]:
        kind = env.units[u]
        out = [health[u] / kind.health]
        if with_shield:
            out.append(shield[u] / kind.shield if kind.shield else 0.0)
        return out + [float(kind.name == t) for t in types]

    # The MAPPO paper's options (its StarCraft2_Env): a unit's last action after its features,
    # for each visible ally and the agent itself, and the agent's one-hot id at the end.
    A = env.n_actions
    last = [[float(a == k) for k in range(A)] for a in st["last_action"][e].tolist()]
    last_len = A if env.obs_last_action else 0
    agent_id = [float(k == i) for k in range(n)] if env.obs_agent_id else []
    nf_e = 4 + 1 + enemy_sh + len(types)
    nf_a = 4 + 1 + ally_sh + len(types) + last_len
    own_len = 1 + ally_sh + len(types) + last_len
    if health[i] <= 0:
        return [0.0] * (4 + m * nf_e + (n - 1) * nf_a + own_len) + agent_id
    avail = _ref_avail(env, st, e, i)
    out = [float(a) for a in avail[2:6]]
    for j in range(m):
        u = n + j
        d = math.dist(pos[i], pos[u])
        if d < 9 and health[u] > 0:
            dx, dy = pos[u][0] - pos[i][0], pos[u][1] - pos[i][1]
            out += [float(avail[6 + j]), d / 9, dx / 9, dy / 9] + unit_feats(u, enemy_sh)
        else:
            out += [0.0] * nf_e
    for u in range(n):
        if u == i:
            continue
        d = math.dist(pos[i], pos[u])
        if d < 9 and health[u] > 0:
            dx, dy = pos[u][0] - pos[i][0], pos[u][1] - pos[i][1]
            out += [1.0, d / 9, dx / 9, dy / 9] + unit_feats(u, ally_sh) + last[u][:last_len]
        else:
            out += [0.0] * nf_a
    return out + unit_feats(i, ally_sh) + last[i][:last_len] + agent_id


def _ref_state(env: SMACEnv, st: dict[str, torch.Tensor], e: int) -> list[float]:
    n = env.n_agents
    pos, health, shield = st["pos"][e].tolist(), st["health"][e].tolist(), st["shield"][e].tolist()
    w, h = env.map.size
    types = env.map.unit_types
    out: list[float] = []
    for side in (range(n), range(n, env.n_units)):
        with_sh = any(env.units[u].shield > 0 for u in side)
        for u in side:
            kind = env.units[u]
            feats = [health[u] / kind.health]
            if u < n:
                cd = st["energy"][e, u] if kind.healer else st["cooldown"][e, u]
                feats.append(float(cd) / kind.smac_max_cooldown)
            feats += [(pos[u][0] - w / 2) / w, (pos[u][1] - h / 2) / h]
            if with_sh:
                feats.append(shield[u] / kind.shield if kind.shield else 0.0)
            feats += [float(kind.name == t) for t in types]
            out += feats if health[u] > 0 else [0.0] * len(feats)
    for a in st["last_action"][e].tolist() if env.state_last_action else []:
        out += [float(a == k) for k in range(env.n_actions)]
    return out


def _ref_state_agent_fp(env: SMACEnv, st: dict[str, torch.Tensor], e: int, i: int) -> list[float]:
    """The MAPPO paper's feature-pruned agent-specific state, written after its code's
    ``StarCraft2_Env.get_state_agent`` (github.com/marlbenchmark/on-policy) with that env's
    defaults (``use_mustalive``, ``add_center_xy``, ``state_last_action``, ``state_agent_id``)."""
    n, m = env.n_agents, env.n_enemies
    pos, health, shield = st["pos"][e].tolist(), st["health"][e].tolist(), st["shield"][e].tolist()
    w, h = env.map.size
    types = env.map.unit_types
    ally_sh = any(u.shield > 0 for u in env.units[:n])
    enemy_sh = any(u.shield > 0 for u in env.units[n:])
    A = env.n_actions
    last_len = A if env.state_last_action else 0
    last = [[float(a == k) for k in range(A)] for a in st["last_action"][e].tolist()]
    nf_a, nf_e = 5 + 1 + ally_sh + 2 + len(types) + last_len, 5 + 1 + enemy_sh + len(types) + 2
    ally = [[0.0] * nf_a for _ in range(n - 1)]
    enemy = [[0.0] * nf_e for _ in range(m)]
    move, own = [0.0] * 4, [0.0] * (4 + 1 + ally_sh + 2 + len(types) + last_len)

    def health_feats(u: int, with_shield: bool) -> list[float]:
        kind = env.units[u]
        out = [health[u] / kind.health]
        return out + [shield[u] / kind.shield if kind.shield else 0.0] * with_shield

    def centre(u: int) -> list[float]:
        return [(pos[u][0] - w / 2) / w, (pos[u][1] - h / 2) / h]

    def type_feats(u: int) -> list[float]:
        return [float(env.units[u].name == t) for t in types]

    if health[i] > 0:
        avail = _ref_avail(env, st, e, i)
        move = [float(a) for a in avail[2:6]]
        for j in range(m):
            u = n + j
            if health[u] > 0:
                d = math.dist(pos[i], pos[u])
                dx, dy = pos[u][0] - pos[i][0], pos[u][1] - pos[i][1]
                enemy[j] = [float(avail[6 + j]), d / 9, dx / 9, dy / 9, float(d < 9)]
                enemy[j] += health_feats(u, enemy_sh) + type_feats(u) + centre(u)
        for k, u in enumerate(v for v in range(n) if v != i):
            if health[u] > 0:
                d = math.dist(pos[i], pos[u])
                dx, dy = pos[u][0] - pos[i][0], pos[u][1] - pos[i][1]
                kind = env.units[u]
                cd = st["energy"][e, u] if kind.healer else st["cooldown"][e, u]
                ally[k] = [float(d < 9), d / 9, dx / 9, dy / 9, float(cd) / kind.smac_max_cooldown]
                ally[k] += health_feats(u, ally_sh) + centre(u) + type_feats(u) + last[u][:last_len]
        own = [1.0, 0.0, 0.0, 0.0] + health_feats(i, ally_sh) + centre(i) + type_feats(i)
        own += last[i][:last_len]
    out = [v for row in ally for v in row] + [v for row in enemy for v in row] + move + own
    return out + [float(k == i) for k in range(n)]


def _masked_random(env: SMACEnv, step, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return random_actions(env, step, gen)


# -- spec and registry ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", REQUIRED_MAPS)
def test_every_map_is_registered_with_smacs_sizes(name: str) -> None:
    env = _env(name, num_envs=2)
    spec = MAPS[name]
    group = env.spec.groups["allies"]
    assert group.agents == tuple(f"ally_{i}" for i in range(spec.n_agents))
    assert (group.obs_shape[0], env.spec.state_shape[0]) == SMAC_SIZES[name]
    assert group.action.nvec == (6 + spec.n_enemies,)
    assert group.has_action_mask
    assert group.agent_state_shape == (
        env.spec.state_shape[0] + group.obs_shape[0] + spec.n_agents,
    )
    assert env.spec.episode_limit == spec.limit
    assert env.spec.stat_names == ("battle_won", "allies_killed", "enemies_killed", "damage_dealt")
    step = env.reset()
    assert step.obs["allies"].shape == (2, spec.n_agents, group.obs_shape[0])
    assert step.agent_state["allies"].shape == (2, spec.n_agents, *group.agent_state_shape)
    assert step.alive["allies"].all()


def test_map_table_matches_smac() -> None:
    assert MAPS["MMM2"].allies == (("marauder", 2), ("marine", 7), ("medivac", 1))
    assert MAPS["MMM2"].enemies == (("marauder", 3), ("marine", 8), ("medivac", 1))
    assert (MAPS["corridor"].n_agents, MAPS["corridor"].n_enemies, MAPS["corridor"].limit) == (
        6,
        24,
        400,
    )
    assert MAPS["2s3z"].unit_types == ("stalker", "zealot")
    assert MAPS["MMM"].unit_types == ("marauder", "marine", "medivac")
    assert MAPS["2m_vs_1z"].unit_types == ()


def test_bad_names_and_parameters_raise() -> None:
    with pytest.raises(EnvError, match="did you mean 'smac/3m'"):
        make("smac/3mm")
    with pytest.raises(EnvError, match="unknown SMAC map '4m'"):
        SMACEnv("4m")
    with pytest.raises(EnvError, match="jitter"):
        make("smac/3m", jitter=-1.0)
    with pytest.raises(EnvError, match="reward_scale_rate"):
        make("smac/3m", reward_scale_rate=0)
    with pytest.raises(EnvError, match="reward_scale_rate must be a positive finite number"):
        make("smac/3m", reward_scale_rate=float("inf"))  # (every quiet step's reward was NaN)
    with pytest.raises(EnvError, match="reward_only_positive must be true or false, got 'false'"):
        make("smac/3m", reward_only_positive="false")  # (read as true)
    with pytest.raises(EnvError, match="unknown parameter 'jiter'; did you mean 'jitter'"):
        make("smac/3m", jiter=0.1)
    with pytest.raises(EnvError, match="'map_name' is set by the env's name"):
        make("smac/3m", map_name="8m")  # ("got multiple values for argument 'map_name'")
    with pytest.raises(EnvError, match="num_envs"):
        make("smac/3m", num_envs=0)
    with pytest.raises(EnvError, match="agent_state must be 'as' .or true., 'fp' or false"):
        make("smac/3m", agent_state="no")
    with pytest.raises(EnvError, match="agent_state must be"):
        make("smac/3m", agent_state=1)
    with pytest.raises(EnvError, match="obs_last_action must be true or false"):
        make("smac/3m", obs_last_action=1)


def test_agent_state_can_be_left_out() -> None:
    # Same battles with and without the agent-specific state, across auto-resets.
    full, lean = (
        _env("3m", num_envs=8, seed=3),
        make("smac/3m", num_envs=8, seed=3, agent_state=False),
    )
    assert lean.spec.groups["allies"].agent_state_shape is None
    gen = torch.Generator().manual_seed(0)
    a, b = full.reset(), lean.reset()
    assert b.agent_state == {}
    ended = 0
    for _ in range(80):
        actions = _masked_random(full, a, gen)
        a, b = full.step(actions), lean.step(actions)
        assert b.agent_state == {} and b.final_agent_state == {}
        assert torch.equal(a.obs["allies"], b.obs["allies"]) and torch.equal(a.state, b.state)
        assert torch.equal(a.final_obs["allies"], b.final_obs["allies"])
        assert torch.equal(a.action_mask["allies"], b.action_mask["allies"])
        ended += int((a.terminated | a.truncated).sum())
    assert ended > 0


@pytest.mark.parametrize("form", ["as", "fp"])
def test_stacked_frames_are_the_episodes_last_k(form: str) -> None:
    """``stacked_frames=k``: every output is the last k frames of its own episode, oldest first,
    zeros before its first step (the final outputs too), with the same battles as unstacked."""
    k = 3
    kwargs = {"num_envs": 6, "seed": 4, "agent_state": form, "obs_last_action": True}
    plain = _env("3m", **kwargs)
    stacked = _env("3m", stacked_frames=k, **kwargs)
    group = stacked.spec.groups["allies"]
    plain_group = plain.spec.groups["allies"]
    assert group.obs_shape == (k * plain_group.obs_shape[0],)
    assert stacked.spec.state_shape == (k * plain.spec.state_shape[0],)
    assert group.agent_state_shape == (k * plain_group.agent_state_shape[0],)

    def stack(frames: list[torch.Tensor]) -> torch.Tensor:
        frames = [torch.zeros_like(frames[0])] * (k - len(frames)) + frames[-k:]
        return torch.cat(frames, -1)

    keys = ("obs", "state", "agent_state")
    a, b = plain.reset(), stacked.reset()

    def frames_of(step) -> dict[str, torch.Tensor]:
        return {"obs": step.obs["allies"], "state": step.state,
                "agent_state": step.agent_state["allies"]}  # fmt: skip

    episodes = [{key: [frames_of(a)[key][e]] for key in keys} for e in range(6)]
    gen = torch.Generator().manual_seed(0)
    ended = 0
    for _ in range(90):  # crosses auto-resets
        actions = _masked_random(plain, a, gen)
        a, b = plain.step(actions), stacked.step(actions)
        assert torch.equal(a.reward["allies"], b.reward["allies"])
        finals = {"obs": a.final_obs["allies"], "state": a.final_state,
                  "agent_state": a.final_agent_state["allies"]}  # fmt: skip
        stacked_finals = {"obs": b.final_obs["allies"], "state": b.final_state,
                          "agent_state": b.final_agent_state["allies"]}  # fmt: skip
        for e in range(6):
            for key in keys:
                history = episodes[e][key]
                assert torch.equal(stacked_finals[key][e], stack([*history, finals[key][e]]))
                if bool(a.done[e]):
                    history.clear()
                    ended += key == "obs"
                history.append(frames_of(a)[key][e])
                assert torch.equal(frames_of(b)[key][e], stack(history)), key
    assert ended >= 6


def test_stacked_frames_go_with_the_env_state() -> None:
    """An env set to another's state (its frames kept included) goes on as that env does; a
    reset or a set battle keeps its frames' shape, and bad frames are named."""
    a = _env("2s3z", num_envs=3, seed=1, stacked_frames=4, agent_state="fp")
    b = _env("2s3z", num_envs=3, seed=2, stacked_frames=4, agent_state="fp")
    gen = torch.Generator().manual_seed(1)
    step = a.reset(seed=1)
    for _ in range(6):
        step = a.step(_masked_random(a, step, gen))
    state = a.get_state()
    assert state["obs_history"].shape == (3, 5, 3, a.obs_dim)
    assert state["state_history"].shape == (3, 3, a.state_dim)
    assert state["agent_state_history"].shape[:3] == (3, 5, 3)
    b.generator.set_state(a.generator.get_state())
    set_step = b.set_state(state)
    assert torch.equal(set_step.obs["allies"], step.obs["allies"])
    assert torch.equal(set_step.agent_state["allies"], step.agent_state["allies"])
    for _ in range(30):
        actions = _masked_random(a, step, gen)
        step, other = a.step(actions), b.step(actions)
        assert torch.equal(step.obs["allies"], other.obs["allies"])
        assert torch.equal(step.state, other.state)
        assert torch.equal(step.final_agent_state["allies"], other.final_agent_state["allies"])
    # Setting part of the battle keeps the frames before the current one.
    before = a.get_state()["obs_history"]
    set_step = a.set_state({"health": a.get_state()["health"]})
    assert torch.equal(a.get_state()["obs_history"], before)
    assert torch.equal(set_step.obs["allies"], step.obs["allies"])
    # (an output already returned is not rewritten by setting the frames)
    held, copy = set_step.obs["allies"], set_step.obs["allies"].clone()
    cleared = a.set_state({"obs_history": torch.zeros_like(before)})
    assert torch.equal(held, copy) and not torch.equal(cleared.obs["allies"], copy)
    with pytest.raises(EnvError, match="state 'obs_history' has shape"):
        a.set_state({"obs_history": torch.zeros(3, 5, 2, a.obs_dim)})
    with pytest.raises(EnvError, match="obs_history"):
        _env("2s3z", num_envs=3).set_state({"obs_history": state["obs_history"]})
    after_reset = a.reset().obs["allies"]
    assert torch.equal(after_reset[..., : 3 * a.obs_dim], torch.zeros(3, 5, 3 * a.obs_dim))


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4"])
def test_bad_stacked_frames_raise(bad: object) -> None:
    with pytest.raises(EnvError, match="stacked_frames must be a whole number >= 1"):
        make("smac/3m", stacked_frames=bad)


def test_bad_actions_raise() -> None:
    env = _env("3m", num_envs=2)
    step = env.reset()
    with pytest.raises(ActionError, match="shape"):
        env.step({"allies": torch.ones(2, 2, dtype=torch.int64)})
    with pytest.raises(ActionError, match="out of range"):
        env.step({"allies": torch.full((2, 3), 9)})
    with pytest.raises(ActionError, match="dtype"):
        env.step({"allies": torch.ones(2, 3)})
    # No-op for a live agent and an attack on an enemy out of range are masked.
    assert not step.action_mask["allies"][..., 0].any()
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step({"allies": torch.zeros(2, 3, dtype=torch.int64)})
    with pytest.raises(ActionError, match="not allowed by its action mask"):
        env.step({"allies": torch.full((2, 3), 6)})


# -- interface against the reference ------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "paper_obs"),
    [("3m", False), ("2s3z", False), ("MMM2", False), ("2m_vs_1z", False), ("corridor", False),
     ("3m", True), ("MMM2", True)],
)  # fmt: skip
def test_masks_observations_and_state_match_smac(name: str, paper_obs: bool) -> None:
    # (the paper's observations, and the state without last actions as PyMARL's COMA has it)
    options = {"obs_last_action": paper_obs, "obs_agent_id": paper_obs}
    options["state_last_action"] = not paper_obs
    env = _env(name, num_envs=3, seed=1, **options)
    if paper_obs:  # the sizes of the paper's env (its 3m: 60 values)
        size = SMAC_SIZES[name][0] + env.n_agents * (env.n_actions + 1)
        assert env.spec.groups["allies"].obs_shape == (size,)
        size = SMAC_SIZES[name][1] - env.n_agents * env.n_actions
        assert env.spec.state_shape == (size,)
    gen = torch.Generator().manual_seed(0)
    step = env.reset()
    checked_dead = checked_attack = False
    for t in range(60):
        st = env.get_state()
        for e in range(env.num_envs):
            np.testing.assert_allclose(step.state[e].tolist(), _ref_state(env, st, e), atol=1e-5)
            for i in range(env.n_agents):
                mask = step.action_mask["allies"][e, i].int().tolist()
                assert mask == _ref_avail(env, st, e, i), (t, e, i)
                obs = step.obs["allies"][e, i]
                np.testing.assert_allclose(obs.tolist(), _ref_obs(env, st, e, i), atol=1e-5)
                agent_state = step.agent_state["allies"][e, i]
                alive = bool(step.alive["allies"][e, i])
                assert alive == (st["health"][e, i] > 0)
                expected = torch.cat((step.state[e] * alive, obs, torch.eye(env.n_agents)[i]))
                assert torch.equal(agent_state, expected)
                if step.final_obs is not None:  # the pre-reset one, built when read
                    assert step.final_state is not None
                    final = step.final_obs["allies"][e, i]  # (a dead agent's: zeros but its id)
                    final = final[: final.numel() - env.n_agents * env.obs_agent_id]
                    final_alive = bool(final.abs().sum() > 0)
                    expected = torch.cat(
                        (
                            step.final_state[e] * final_alive,
                            step.final_obs["allies"][e, i],
                            torch.eye(env.n_agents)[i],
                        )
                    )
                    assert torch.equal(step.final_agent_state["allies"][e, i], expected)
                checked_dead |= not alive
                checked_attack |= any(mask[6:])
        step = env.step(_masked_random(env, step, gen))
    assert checked_attack
    if name in ("3m", "2s3z"):
        assert checked_dead


@pytest.mark.parametrize(
    ("name", "last_action"), [("3m", True), ("2s3z", True), ("MMM2", True), ("corridor", False)]
)
def test_feature_pruned_agent_state_matches_the_papers_env(name: str, last_action: bool) -> None:
    env = _env(name, num_envs=3, seed=2, agent_state="fp", state_last_action=last_action)
    size = len(_ref_state_agent_fp(env, env.get_state(), 0, 0))
    assert env.spec.groups["allies"].agent_state_shape == (size,)
    if name == "3m":  # the paper's env: 3m's agent-specific state is 81 values
        assert size == 81
    plain = _env(name, num_envs=3, seed=2, state_last_action=last_action)
    gen = torch.Generator().manual_seed(0)
    step, same = env.reset(), plain.reset()
    checked_dead = checked_final = False
    for t in range(60):
        st = env.get_state()
        for e in range(env.num_envs):
            for i in range(env.n_agents):
                got = step.agent_state["allies"][e, i].tolist()
                expected = _ref_state_agent_fp(env, st, e, i)
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{t} {e} {i}")
                checked_dead |= not bool(step.alive["allies"][e, i])
        actions = _masked_random(env, step, gen)
        before = env.get_state()
        step, same = env.step(actions), plain.step(actions)
        # only the critic's input differs from the "AS" env's step
        assert torch.equal(step.obs["allies"], same.obs["allies"])
        assert torch.equal(step.state, same.state)
        ended = (step.terminated | step.truncated).nonzero().flatten().tolist()
        if ended:
            # the pre-reset battle: the step simulated again from the state before it
            replay = _env(name, num_envs=3, seed=2, agent_state="fp", state_last_action=last_action)
            replay.set_state(before)
            final_st = replay._simulate(replay._s, actions["allies"].reshape(3, -1))[0]
            for e in ended:
                for i in range(env.n_agents):
                    got = step.final_agent_state["allies"][e, i].tolist()
                    expected = _ref_state_agent_fp(env, final_st, e, i)
                    np.testing.assert_allclose(got, expected, atol=1e-5)
            checked_final = True
    assert checked_dead or name in ("MMM2", "corridor")
    assert checked_final


def test_masks_never_allow_impossible_actions() -> None:
    env = _env("MMM", num_envs=64, seed=2)
    gen = torch.Generator().manual_seed(1)
    step = env.reset()
    n = env.n_agents
    healer = torch.tensor([u.healer for u in env.units[:n]])
    for _ in range(150):
        st = env.get_state()
        mask = step.action_mask["allies"]
        alive = st["health"] > 0
        me = alive[:, :n]
        assert torch.equal(mask[..., 0], ~me)  # no-op exactly when dead
        assert not mask[~me][:, 1:].any()  # a dead agent can do nothing else
        d = torch.cdist(st["pos"][:, :n], st["pos"])
        attack = mask[..., 6:] & ~healer[:, None]
        assert not (attack & ~alive[:, None, n:]).any()
        assert not (attack & (d[:, :, n:] > 6)).any()
        heal = mask[..., 6 : 6 + n] & healer[:, None]
        hurt = st["health"][:, :n] < torch.tensor([u.health for u in env.units[:n]])
        assert not (heal & ~(alive[:, None, :n] & hurt[:, None, :] & ~healer)).any()
        assert not (heal & (d[:, :, :n] > 6)).any()
        assert not (mask[..., 6 + n :] & healer[:, None]).any()
        step = env.step(_masked_random(env, step, gen))


# -- combat figures by hand ---------------------------------------------------------------------
def _duel(
    name: str, ally_pos, enemy_pos, env_kwargs: dict | None = None, **overrides
) -> tuple[SMACEnv, EnvStep]:
    """Env with ally 0 and enemy 0 alive at the given positions, every other unit dead;
    ``env_kwargs`` go to ``make``; ``overrides`` maps a state key to ``(unit index or None,
    value)``."""
    env = _env(name, **(env_kwargs or {}))
    env.reset()
    st = env.get_state()
    n = env.n_agents
    st["health"][0, 1:n] = 0
    st["health"][0, n + 1 :] = 0
    st["pos"][0, 0] = torch.tensor(ally_pos)
    st["pos"][0, n] = torch.tensor(enemy_pos)
    for key, (unit, value) in overrides.items():
        if unit is None:
            st[key][0] = value
        else:
            st[key][0, unit] = value
    return env, env.set_state(st)


def _act(env: SMACEnv, action: int) -> None:
    acts = torch.zeros(1, env.n_agents, dtype=torch.int64)
    acts[0, 0] = action
    env.step({"allies": acts})


def test_marine_duel_damage_and_cooldown() -> None:
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0))  # 5.5 apart: both in range (5 + 0.75)
    period = loops(0.61)
    expected_cd = 0.0
    expected_hp = 45.0
    for t in range(6):
        _act(env, 6)
        st = env.get_state()
        fired = expected_cd < 8
        expected_hp -= 6.0 * fired
        expected_cd = expected_cd + period - 8 if fired else max(expected_cd - 8, 0.0)
        assert st["health"][0, 3].item() == pytest.approx(expected_hp), t
        assert st["health"][0, 0].item() == pytest.approx(expected_hp), t  # the AI fires back
        assert st["cooldown"][0, 0].item() == pytest.approx(expected_cd, abs=1e-4), t
    # 4 shots in 48 game loops, at loops 0, 13.7, 27.3 and 41 (the residual cooldown carries
    # over from step to step).
    assert expected_hp == 45.0 - 6 * 4


def test_shields_armour_and_bonus_damage() -> None:
    # Stalker (13, +5 vs Armored) on a zealot (Light): shields first, no armour on shields.
    env, _ = _duel("3s_vs_3z", (10.0, 16.0), (15.9, 16.0))
    _act(env, 6)
    st = env.get_state()
    assert st["shield"][0, 3].item() == pytest.approx(37.0)
    assert st["health"][0, 3].item() == pytest.approx(100.0)
    # A hit that breaks the shield: 5 absorbed, (13 - 5) - armour 1 = 7 to health.
    env, _ = _duel("3s_vs_3z", (10.0, 16.0), (15.9, 16.0), shield=(3, 5.0))
    _act(env, 6)
    st = env.get_state()
    assert st["shield"][0, 3].item() == 0.0
    assert st["health"][0, 3].item() == pytest.approx(93.0)
    # With no shield left the whole hit pays the armour: 13 - 1 = 12.
    env, _ = _duel("3s_vs_3z", (10.0, 16.0), (15.9, 16.0), shield=(3, 0.0))
    _act(env, 6)
    assert env.get_state()["health"][0, 3].item() == pytest.approx(88.0)
    # Stalker on a stalker (Armored): 13 + 5 = 18 each way.
    env, _ = _duel("2s3z", (10.0, 16.0), (15.9, 16.0))
    _act(env, 6)
    st = env.get_state()
    assert st["shield"][0, 5].item() == pytest.approx(80.0 - 18.0)
    assert st["shield"][0, 0].item() == pytest.approx(80.0 - 18.0)


def test_zealot_hits_twice_and_marines_pay_no_armour() -> None:
    # Zealot (2 x 8) against a marine in melee reach (0.1 + 0.5 + 0.375): 16 damage.
    env, _ = _duel("2m_vs_1z", (10.0, 16.0), (10.9, 16.0))
    _act(env, 6)
    st = env.get_state()
    assert st["health"][0, 0].item() == pytest.approx(45.0 - 16.0)
    # The marine's 6 hits the zealot's shield (no armour on shields).
    assert st["shield"][0, 2].item() == pytest.approx(44.0)
    # Two hits on 4 shield points: the first breaks it (4 absorbed, 4 - 1 = 3 to health), the
    # second pays the armour in full (8 - 1 = 7): 10 to health.
    # Ally zealot 0 is unit 2 in 2s3z: put it next to enemy stalker 0 (unit 5), both alone.
    env_z = _env("2s3z")
    st = env_z.get_state()
    st["health"][0, :] = 0
    st["health"][0, 2] = 100.0
    st["health"][0, 5] = 80.0
    st["shield"][0, 5] = 4.0
    st["pos"][0, 2] = torch.tensor([10.0, 16.0])
    st["pos"][0, 5] = torch.tensor([11.15, 16.0])  # reach 0.1 + 0.5 + 0.625 = 1.225
    env_z.set_state(st)
    acts = torch.tensor([[0, 0, 6, 0, 0]])
    env_z.step({"allies": acts})
    st = env_z.get_state()
    assert st["shield"][0, 5].item() == 0.0
    assert st["health"][0, 5].item() == pytest.approx(80.0 - 10.0)


def test_shield_regeneration_waits_ten_game_seconds() -> None:
    # A lone zealot far from a stalker: no damage this step.
    env, _ = _duel("3s_vs_3z", (4.0, 4.0), (28.0, 28.0), shield=(3, 10.0), since_damage=(3, 152.0))
    _act(env, 1)
    st = env.get_state()
    assert st["shield"][0, 3].item() == pytest.approx(11.0)  # 160 loops reached: +2/s * 0.5 s
    env, _ = _duel("3s_vs_3z", (4.0, 4.0), (28.0, 28.0), shield=(3, 10.0), since_damage=(3, 144.0))
    _act(env, 1)
    assert env.get_state()["shield"][0, 3].item() == pytest.approx(10.0)


def test_medivac_heals_with_energy() -> None:
    env = _env("MMM")
    env.reset()
    st = env.get_state()
    medivac = 9
    st["health"][0, 10:] = 0  # no enemies near: put them all dead but one far away
    st["health"][0, 10] = 125.0
    st["pos"][0, 10] = torch.tensor([30.0, 30.0])
    st["health"][0, 0] = 100.0  # marauder 0, injured
    st["pos"][0, 0] = torch.tensor([10.0, 10.0])
    st["pos"][0, medivac] = torch.tensor([12.0, 10.0])  # in heal reach (4 + 0.5625 + 0.75)
    step = env.set_state(st)
    assert step.action_mask["allies"][0, medivac, 6].item()  # heal ally 0
    assert not step.action_mask["allies"][0, medivac, 7].item()  # ally 1 is not hurt
    acts = torch.ones(1, 10, dtype=torch.int64)
    acts[0, medivac] = 6
    env.step({"allies": acts})
    st = env.get_state()
    assert st["health"][0, 0].item() == pytest.approx(104.5)  # 9 per game second * 0.5 s
    assert st["energy"][0, medivac].item() == pytest.approx(50.0 - 1.5 + 0.28125)


def test_stop_fires_at_an_enemy_in_range_and_moves_move() -> None:
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0))
    _act(env, 1)
    assert env.get_state()["health"][0, 3].item() == pytest.approx(39.0)
    env, _ = _duel("3m", (10.0, 16.0), (30.0, 30.0))
    _act(env, 4)  # east
    speed = 3.15 / 22.4 * 8
    assert env.get_state()["pos"][0, 0].tolist() == pytest.approx([10.0 + speed, 16.0])


def test_attack_out_of_range_closes_in_first() -> None:
    # 5.9 apart: available (SMAC's shooting range 6) but beyond the marine's reach 5.75.
    env, _ = _duel("3m", (10.0, 16.0), (15.9, 16.0))
    _act(env, 6)
    st = env.get_state()
    # Both close in (the AI moves toward its target too) and nobody fires this step.
    assert st["health"][0, 3].item() == 45.0
    assert st["pos"][0, 3, 0] - st["pos"][0, 0, 0] <= 5.75
    _act(env, 6)
    assert env.get_state()["health"][0, 3].item() == pytest.approx(39.0)


# -- rewards, ends and statistics ----------------------------------------------------------------
def test_win_reward_stats_and_auto_reset() -> None:
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0), health=(3, 1.0))
    st = env.get_state()
    step = env.step({"allies": torch.tensor([[6, 0, 0]])})
    max_reward = 3 * 45 + 3 * 10 + 200
    assert step.terminated.item() and not step.truncated.item()
    # 1 health + 10 for the kill + 200 for the win, scaled so that the best return is 20.
    assert step.reward["allies"][0].tolist() == pytest.approx([211 * 20 / max_reward] * 3)
    assert step.stats["battle_won"].item() == 1.0
    assert step.stats["enemies_killed"].item() == 3.0
    assert step.stats["allies_killed"].item() == 2.0
    assert step.stats["damage_dealt"].item() == pytest.approx(1.0)
    # Auto-reset: the final observation is the dead enemy's, the new one a full battle.
    assert step.final_obs is not None and step.final_state is not None
    assert step.final_obs["allies"][0, 0, 4:9].abs().sum() == 0  # enemy 0 gone
    assert step.alive["allies"].all()
    assert env.get_state()["health"].min().item() == 45.0
    assert env.get_state()["t"].item() == 0
    assert not torch.equal(env.get_state()["pos"], st["pos"])


def test_loss_draw_and_time_limit() -> None:
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0), health=(0, 3.0))
    step = env.step({"allies": torch.tensor([[1, 0, 0]])})
    assert step.terminated.item() and step.stats["battle_won"].item() == 0.0
    assert step.stats["allies_killed"].item() == 3.0
    assert step.reward["allies"][0, 0].item() == pytest.approx(6 * 20 / 365)
    # Both last units die in the same step: terminated, not won.
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0), health=(0, 3.0))
    env.set_state({"health": torch.tensor([[3.0, 0, 0, 4.0, 0, 0]])})
    step = env.step({"allies": torch.tensor([[6, 0, 0]])})
    assert step.terminated.item() and step.stats["battle_won"].item() == 0.0
    # Time limit: a truncation, not a termination.
    env, _ = _duel("3m", (2.0, 2.0), (30.0, 30.0), t=(None, 59))
    step = env.step({"allies": torch.tensor([[1, 0, 0]])})
    assert step.truncated.item() and not step.terminated.item()
    assert step.stats["battle_won"].item() == 0.0


def test_only_medivacs_left_loses() -> None:
    env = _env("MMM")
    env.reset()
    st = env.get_state()
    st["health"][0, 1:9] = 0  # allies: marauder 0 and the medivac left
    st["health"][0, 0] = 1.0
    st["pos"][0, 0] = torch.tensor([10.0, 16.0])
    st["pos"][0, 10] = torch.tensor([15.0, 16.0])  # enemy marauder 0 in range
    env.set_state(st)
    acts = torch.ones(1, 10, dtype=torch.int64)
    acts[0, 1:9] = 0
    step = env.step({"allies": acts})
    assert step.terminated.item() and step.stats["battle_won"].item() == 0.0


def test_episode_returns_are_scaled_to_twenty() -> None:
    env = _env("3m", num_envs=64, seed=3)
    step = env.reset()
    ret = torch.zeros(64)
    wins, returns = [], []
    for _ in range(61):
        step = env.step(scripted_actions(env, step, focus=True))
        ret += step.reward["allies"][:, 0]
        assert torch.equal(step.reward["allies"], step.reward["allies"][:, :1].expand(64, 3))
        assert (step.reward["allies"] >= 0).all()
        for e in step.done.nonzero().flatten().tolist():
            wins.append(step.stats["battle_won"][e].item())
            returns.append(ret[e].item())
        ret = torch.where(step.done, 0.0, ret)
    assert len(wins) >= 64
    for won, r in zip(wins, returns, strict=True):
        # No shields or heals on 3m: a win is worth exactly the maximum return of 20.
        assert r == pytest.approx(20.0, abs=1e-3) if won else r < 20.0


def test_regeneration_reward_option() -> None:
    # An enemy zealot out of everyone's reach, its shield regenerating (ten game seconds
    # without damage): SMAC's abs() pays the regeneration as if it were damage; the signed
    # reward counts it against the damage dealt.
    def regenerate(**kwargs: bool) -> float:
        env, _ = _duel(
            "3s_vs_3z", (28.0, 28.0), (4.0, 4.0), kwargs, shield=(3, 10.0), since_damage=(3, 200.0)
        )
        step = env.step({"allies": torch.tensor([[1, 0, 0]])})
        # 2 per game second of 16 game loops, over the step's 8 loops.
        assert env.get_state()["shield"][0, 3].item() == pytest.approx(11.0)
        return step.reward["allies"][0, 0].item()

    max_reward = 3 * (100 + 50) + 3 * 10 + 200
    regen = 1.0 * 20 / max_reward
    assert regenerate() == pytest.approx(regen)
    assert regenerate(regeneration_reward=False) == pytest.approx(-regen)
    with pytest.raises(EnvError, match="regeneration_reward must be true or false"):
        make("smac/3m", regeneration_reward="no")


def test_negative_rewards_option() -> None:
    env, _ = _duel("3m", (10.0, 16.0), (15.5, 16.0), {"reward_only_positive": False})
    step = env.step({"allies": torch.tensor([[1, 0, 0]])})
    # Both deal 6: +6 for the damage dealt, -0.5 * 6 for the damage taken.
    assert step.reward["allies"][0, 0].item() == pytest.approx((6 - 3) * 20 / 365)


# -- batching, seeding, death masking ------------------------------------------------------------
def test_batch_consistency() -> None:
    big = _env("2s3z", num_envs=4, seed=5)
    gen = torch.Generator().manual_seed(3)
    step = big.reset()
    start = big.get_state()
    actions = []
    for _ in range(40):
        a = _masked_random(big, step, gen)
        actions.append(a["allies"])
        step = big.step(a)
    k = 2
    single = _env("2s3z", num_envs=1, seed=99)
    s_step = single.set_state({key: v[k : k + 1] for key, v in start.items()})
    b_step = big.set_state(start)
    for a in actions:
        assert torch.equal(s_step.obs["allies"][0], b_step.obs["allies"][k])
        assert torch.equal(s_step.state[0], b_step.state[k])
        s_step = single.step({"allies": a[k : k + 1]})
        b_step = big.step({"allies": a})
        assert torch.equal(s_step.reward["allies"][0], b_step.reward["allies"][k])
        assert s_step.final_obs is not None and b_step.final_obs is not None
        assert torch.equal(s_step.final_obs["allies"][0], b_step.final_obs["allies"][k])
        if b_step.done[k]:
            # After an auto-reset each env starts from its own draw.
            assert s_step.done[0]
            break


def test_same_seed_replays_and_other_seed_differs() -> None:
    def run(seed: int) -> list[torch.Tensor]:
        env = _env("3m", num_envs=8, seed=seed)
        gen = torch.Generator().manual_seed(0)
        step = env.reset(seed=seed)
        out = [step.obs["allies"]]
        for _ in range(70):  # crosses auto-resets
            step = env.step(_masked_random(env, step, gen))
            out.append(step.obs["allies"])
        return out

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_global_rng_is_untouched() -> None:
    before = torch.random.get_rng_state()
    env = _env("2s3z", num_envs=8, seed=0)
    gen = torch.Generator().manual_seed(0)
    step = env.reset(seed=1)
    for _ in range(30):
        step = env.step(_masked_random(env, step, gen))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_dead_agents_are_masked() -> None:
    env, step = _duel("3m", (10.0, 16.0), (15.5, 16.0))
    assert step.alive["allies"][0].tolist() == [True, False, False]
    assert step.obs["allies"][0, 1:].abs().sum() == 0
    agent_state = step.agent_state["allies"][0, 1]
    assert agent_state[: -env.n_agents].abs().sum() == 0
    assert agent_state[-env.n_agents :].tolist() == [0.0, 1.0, 0.0]


def test_state_injection_errors() -> None:
    env = _env("3m", num_envs=2)
    with pytest.raises(EnvError, match="unknown state keys"):
        env.set_state({"hp": torch.zeros(2, 6)})
    with pytest.raises(EnvError, match="shape"):
        env.set_state({"health": torch.zeros(2, 5)})
    env.set_state({"health": torch.zeros(1, 6)}, env_ids=torch.tensor([1]))
    assert env.get_state()["health"][1].sum() == 0 and env.get_state()["health"][0].sum() > 0


# -- rendering and the PettingZoo view ------------------------------------------------------------
def test_render_draws_both_sides() -> None:
    env = _env("MMM", num_envs=2, seed=0)
    step = env.reset()
    for _ in range(8):
        step = env.step(scripted_actions(env, step))
    frame = env.render(env_index=1, size=200)
    assert frame.shape == (200, 200, 3) and frame.dtype == np.uint8
    pixels = frame.reshape(-1, 3).astype(int)
    blue = (pixels[:, 2] > 200) & (pixels[:, 0] < 100)
    red = (pixels[:, 0] > 200) & (pixels[:, 2] < 100) & (pixels[:, 1] < 100)
    assert blue.sum() > 20 and red.sum() > 20
    frames = record_episode(env, lambda s: scripted_actions(env, s), num_steps=5)
    assert len(frames) == 6 and all(f.shape == (400, 400, 3) for f in frames)
    with pytest.raises(IndexError):
        env.render(env_index=2)


def test_pettingzoo_api() -> None:
    parallel_api_test(PettingZooView("smac/3m", seed=1), num_cycles=80)


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, str(DOCS), "exec"), {})
    assert (tmp_path / "mmm.gif").stat().st_size > 0
