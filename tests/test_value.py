"""The value-decomposition family (IQL, VDN, QMIX): mixers, targets, exploration, the episode
collector and buffer, the loss, and runs end to end (train, resume, evaluate, load)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import mappo
from mappo import config as C
from mappo.algos.coma import coma_advantage, counterfactual_baseline, final_step_mask
from mappo.algos.returns import lambda_targets, n_step_targets
from mappo.algos.value import epsilon_at, td_loss
from mappo.cli import main
from mappo.envs import make
from mappo.episodes import EpisodeBuffer, EpisodeCollector, allocate_episodes, check_bytes
from mappo.logging import is_column_name
from mappo.nn.coma import ComaCritic, coma_policy
from mappo.nn.q_agents import QMixer, QNetworks, VDNMixer, epsilon_greedy
from mappo.rollout import EpisodeTracker
from mappo.trainer import latest_checkpoint, load_checkpoint, resume, train

# -- mixers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_qmix_is_monotone_in_every_agent_q(layers):
    torch.manual_seed(0)
    mixer = QMixer(state_dim=7, num_agents=4, embed=8, hypernet_layers=layers, hyper_embed=16)
    q = torch.randn(64, 4, requires_grad=True)
    state = torch.randn(64, 7) * 3
    (grad,) = torch.autograd.grad(mixer(q, state).sum(), q)
    assert grad.shape == (64, 4)
    assert bool((grad >= 0).all())
    assert bool((grad > 0).any())


def test_vdn_is_the_sum_of_agent_qs():
    q = torch.randn(5, 3, 4)
    torch.testing.assert_close(VDNMixer()(q, torch.randn(5, 3, 2)), q.sum(-1, keepdim=True))


# -- targets -------------------------------------------------------------------------------------

# Two episodes, gamma 0.9. A terminates after step 2 (step 3 is padding); B is truncated by its
# time limit after step 1 (steps 2-3 are padding): B's last target bootstraps from its final
# observation's value, A's does not.
GAMMA = 0.9
REWARDS = torch.tensor([[1.0, 1.0], [2.0, 1.0], [3.0, 0.0], [0.0, 0.0]])
NEXT_V = torch.tensor([[10.0, 5.0], [20.0, 7.0], [30.0, 0.0], [0.0, 0.0]])
TERMINATED = torch.tensor([[False, False], [False, False], [True, False], [False, False]])
ENDS = torch.tensor([[False, False], [False, True], [True, False], [False, False]])


def test_one_step_targets_by_hand():
    out = n_step_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 1)
    torch.testing.assert_close(out[:3, 0], torch.tensor([10.0, 20.0, 3.0]))
    torch.testing.assert_close(out[:2, 1], torch.tensor([5.5, 7.3]))


def test_n_step_targets_by_hand():
    out = n_step_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 2)
    # A: 1 + .9 * 2 + .81 * V(s2); 2 + .9 * 3 (terminated: no bootstrap); 3.
    torch.testing.assert_close(out[:3, 0], torch.tensor([19.0, 4.7, 3.0]))
    # B: 1 + .9 * 1 + .81 * V(final) = 7.57; the last step 1 + .9 * 7.
    torch.testing.assert_close(out[:2, 1], torch.tensor([7.57, 7.3]))
    # Longer windows than the episode change nothing past its end.
    torch.testing.assert_close(
        n_step_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 10)[:3, 0],
        torch.tensor([1 + 0.9 * 2 + 0.81 * 3, 2 + 0.9 * 3, 3.0]),
    )


def test_lambda_targets_by_hand():
    out = lambda_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 0.5)
    # A: G2 = 3; G1 = 2 + .9 (.5 * 20 + .5 * 3) = 12.35; G0 = 1 + .9 (.5 * 10 + .5 * 12.35).
    torch.testing.assert_close(out[:3, 0], torch.tensor([11.0575, 12.35, 3.0]))
    # B: G1 = 1 + .9 * 7 = 7.3 (truncated: bootstrapped); G0 = 1 + .9 (.5 * 5 + .5 * 7.3).
    torch.testing.assert_close(out[:2, 1], torch.tensor([6.535, 7.3]))
    one = n_step_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 1)
    torch.testing.assert_close(lambda_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 0.0), one)


def test_targets_broadcast_over_agents():
    r = REWARDS.unsqueeze(-1).expand(-1, -1, 3)
    v = NEXT_V.unsqueeze(-1).expand(-1, -1, 3)
    out = lambda_targets(r, v, TERMINATED, ENDS, GAMMA, 0.5)
    ref = lambda_targets(REWARDS, NEXT_V, TERMINATED, ENDS, GAMMA, 0.5)
    torch.testing.assert_close(out, ref.unsqueeze(-1).expand(-1, -1, 3))


# -- exploration ---------------------------------------------------------------------------------


def test_epsilon_schedules():
    lin = C.ValueConfig(epsilon_start=1.0, epsilon_finish=0.05, epsilon_anneal_steps=1000)
    assert epsilon_at(0, lin) == 1.0
    assert epsilon_at(500, lin) == pytest.approx(0.525)
    assert epsilon_at(1000, lin) == pytest.approx(0.05)
    assert epsilon_at(10**6, lin) == pytest.approx(0.05)
    exp = C.ValueConfig(
        epsilon_start=1.0,
        epsilon_finish=0.01,
        epsilon_anneal_steps=1000,
        epsilon_schedule=("exponential"),
    )
    assert epsilon_at(0, exp) == 1.0
    assert epsilon_at(500, exp) == pytest.approx(0.1)  # sqrt(1.0 * 0.01)
    assert epsilon_at(1000, exp) == pytest.approx(0.01)
    assert epsilon_at(5000, exp) == pytest.approx(0.01)


def test_epsilon_greedy_never_picks_a_masked_action():
    g = torch.Generator().manual_seed(0)
    E, n, A = 4096, 3, 6
    q = torch.randn(E, n, A, generator=g)
    mask = torch.rand(E, n, A, generator=g) < 0.4
    mask[..., 0] |= ~mask.any(-1)  # at least one allowed action per agent
    q[..., :] += 100.0 * (~mask)  # masked actions have the highest Q: greedy must skip them
    for eps in (0.0, 0.3, 1.0):
        a = epsilon_greedy(q, mask, eps, g)
        assert bool(mask.gather(-1, a.unsqueeze(-1)).all())
    # Greedy picks the best allowed action.
    best = q.masked_fill(~mask, -torch.inf).argmax(-1)
    assert torch.equal(epsilon_greedy(q, mask, 0.0, g), best)
    # Epsilon 1 is uniform over the allowed actions of an agent.
    one = torch.zeros(20000, 1, A, dtype=torch.bool)
    one[..., [1, 3, 4]] = True
    counts = torch.bincount(
        epsilon_greedy(torch.zeros(20000, 1, A), one, 1.0, g).flatten(), None, A
    )
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts[[1, 3, 4]].float() / 20000 - 1 / 3).abs().max() < 0.02


# -- collection, buffer, loss --------------------------------------------------------------------


def _qmix_cfg(env_name: str, **over) -> C.TrainConfig:
    return C.load("smac/3m_qmix", {"env.name": env_name, **over})


def _collect(env_name: str, num_envs: int, seed: int = 0):
    env = mappo.envs.make(env_name, num_envs=num_envs, seed=seed)
    cfg = _qmix_cfg(env_name)
    torch.manual_seed(seed)
    nets = QNetworks(env.spec, cfg.model, cfg.algo)
    env.reset(seed=seed)
    tracker = EpisodeTracker.create(num_envs, env.spec.stat_names, env.device)
    collector = EpisodeCollector(env, nets, torch.Generator().manual_seed(seed), tracker)
    return env, nets, cfg, collector, tracker


def test_collector_records_whole_episodes_with_their_end():
    env, nets, cfg, collector, tracker = _collect("smac/3m", 16)
    batch, steps = collector.collect(epsilon=1.0, seed=0)
    lengths = batch.filled.sum(0)
    assert steps == int(lengths.sum())
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= env.spec.episode_limit
    E = 16
    for e in range(E):
        T = int(lengths[e])
        assert bool(batch.filled[:T, e].all()) and not bool(batch.filled[T:, e].any())
        # Exactly one end, at the last step, and termination and truncation are exclusive.
        assert batch.ends[:, e].nonzero().flatten().tolist() == [T - 1]
        assert not bool(batch.terminated[T - 1, e] & batch.truncated[T - 1, e])
        # The final state follows (the observations of a lost battle are all zero: every ally
        # is dead); the padding after it is zero.
        assert float(batch.state[T, e].abs().sum()) > 0
        assert float(batch.state[T + 1 :, e].abs().sum()) == 0
        assert float(batch.obs["allies"][T + 1 :, e].abs().sum()) == 0
        assert int(batch.actions["allies"][T:, e].abs().sum()) == 0
    # Every taken action was allowed.
    mask = batch.action_mask["allies"][:-1]
    taken = mask.gather(-1, batch.actions["allies"][:-1])[..., 0]
    assert bool(taken[batch.filled[:-1]].all())
    # The tracker counted each env's episode once.
    assert tracker.read()["episodes"] == E


def test_asking_for_the_episodes_ends_every_few_steps_stores_the_same_batch(monkeypatch):
    # On a GPU the collector asks whether all episodes ended every 8 steps (each answer waits
    # for the device): the steps it takes past the last end must store nothing.
    import mappo.episodes

    def copied(value):
        if isinstance(value, dict):
            return {k: v.clone() for k, v in value.items()}
        return value.clone()

    runs = []
    for every in (1, 8):
        monkeypatch.setattr(mappo.episodes, "end_check_every", lambda device, n=every: n)
        env, _, _, collector, tracker = _collect("smac/3m", 8, seed=5)
        stepped = []
        counted = lambda a, step=env.step, log=stepped: log.append(1) or step(a)  # noqa: E731
        monkeypatch.setattr(env, "step", counted)
        batch, steps = collector.collect(epsilon=0.5, seed=2)
        fields = {k: copied(v) for k, v in vars(batch).items()}
        runs.append((fields, steps, tracker.read(), len(stepped)))
    (fields_1, steps_1, stats_1, calls_1), (fields_8, steps_8, stats_8, calls_8) = runs
    assert calls_8 > calls_1 == int(fields_1["filled"].sum(0).max())  # steps past the ends
    assert steps_1 == steps_8 and stats_1 == stats_8
    for k, v in fields_1.items():
        for name, x in (v if isinstance(v, dict) else {"": v}).items():
            y = fields_8[k][name] if isinstance(v, dict) else fields_8[k]
            assert torch.equal(x, y), (k, name)


def test_collector_final_observation_matches_the_env():
    """Replaying the recorded actions in a copy of the env gives the recorded observations and
    the final (pre-reset) observation after the last step."""
    env, nets, cfg, collector, _ = _collect("smac/3m", 4, seed=3)
    replay = mappo.envs.make("smac/3m", num_envs=4, seed=3)
    replay.validate_actions = False  # finished envs replay zeros (no action was recorded)
    batch, _ = collector.collect(epsilon=0.5, seed=11)
    step = replay.reset(seed=11)
    T = batch.filled.sum(0)
    for t in range(int(T.max())):
        live = batch.filled[t]
        torch.testing.assert_close(step.obs["allies"][live], batch.obs["allies"][t][live])
        step = replay.step({"allies": batch.actions["allies"][t]})
        ended = step.done & live
        torch.testing.assert_close(
            step.final_obs["allies"][ended], batch.obs["allies"][t + 1][ended]
        )
        torch.testing.assert_close(step.reward["allies"].mean(1)[live], batch.reward[t][live])
        # The masks of the final observation are the env's own.
        torch.testing.assert_close(
            step.final_action_mask["allies"][ended], batch.action_mask["allies"][t + 1][ended]
        )


def test_buffer_wraps_around_and_samples_distinct_episodes():
    env, nets, cfg, collector, _ = _collect("mpe/simple_spread", 3)
    buf = EpisodeBuffer(collector.batch, capacity=5)
    marks = []
    for i in range(3):  # 9 episodes into 5 slots: the oldest 4 are overwritten
        batch, _ = collector.collect(epsilon=1.0, seed=i)
        batch.reward[0] = torch.tensor([10.0 * i + k for k in range(3)])
        marks += batch.reward[0].tolist()
        buf.add(batch)
    assert buf.size == 5 and buf.index == 9 % 5
    stored = sorted(buf.storage.reward[:, 0].tolist())
    assert stored == sorted(marks[-5:])
    g = torch.Generator().manual_seed(0)
    sample = buf.sample(5, g)
    assert sample.reward.shape[:2] == (26, 5)  # time-major, the 25-step episodes + final obs
    assert sorted(sample.reward[0].tolist()) == stored  # without replacement
    restored = EpisodeBuffer(allocate_episodes(env, 3), capacity=5)
    restored.load_state_dict(buf.state_dict())
    assert restored.index == buf.index and restored.size == buf.size
    assert torch.equal(restored.storage.obs["agents"], buf.storage.obs["agents"])


def _fields(batch) -> dict[str, torch.Tensor]:
    """Every tensor of an :class:`EpisodeBatch` by ``field`` or ``field/group``."""
    out = {}
    for name, value in batch.fields().items():
        if isinstance(value, dict):
            out.update({f"{name}/{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def _assert_same_episodes(got, want) -> None:
    """Two batches hold the same values in the same dtypes (a sample against the episodes)."""
    got, want = _fields(got), _fields(want)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


def _buffer_of_one_batch(env_name: str, num_envs: int):
    """A buffer of ``num_envs`` slots holding one collected batch (bytes where the env declares
    them), and a copy of that batch."""
    env, nets, cfg, collector, _ = _collect(env_name, num_envs)
    buf = EpisodeBuffer(collector.batch, num_envs, env.byte_observations)
    batch, _ = collector.collect(epsilon=1.0, seed=0)
    kept = batch.map(lambda x: x.clone())
    buf.add(batch)
    return env, buf, kept


def test_hanabi_observations_are_stored_as_bytes_and_sampled_as_they_were():
    """Hanabi declares its 0/1 observations and states: they take a byte each in the buffer (a
    quarter of float32) and come back from a sample as the same float32 values."""
    env, buf, kept = _buffer_of_one_batch("hanabi/small-2p", 4)
    assert env.byte_observations
    assert buf.storage.obs["players"].dtype == torch.uint8
    assert buf.storage.state.dtype == torch.uint8
    order = torch.randperm(4, generator=torch.Generator().manual_seed(3))
    sample = buf.sample(4, torch.Generator().manual_seed(3))
    T = int(kept.filled.sum(0).max()) + 1
    _assert_same_episodes(sample, kept.map(lambda x: x[:T, order]))
    # A checkpoint keeps the bytes, and restores the same samples.
    state = buf.state_dict()
    assert state["episodes"]["obs"]["players"].dtype == torch.uint8
    restored = EpisodeBuffer(allocate_episodes(env, 4), 4, byte_observations=True)
    restored.load_state_dict(state)
    _assert_same_episodes(restored.sample(4, torch.Generator().manual_seed(3)), sample)
    # A checkpoint of float episodes (written before the byte storage) loads into bytes, and a
    # checkpoint of bytes into a float buffer: the same samples either way.
    old = {**state, "episodes": {**state["episodes"]}}
    old["episodes"]["obs"] = {"players": state["episodes"]["obs"]["players"].float()}
    old["episodes"]["state"] = state["episodes"]["state"].float()
    older = EpisodeBuffer(allocate_episodes(env, 4), 4, byte_observations=True)
    older.load_state_dict(old)
    assert older.storage.obs["players"].dtype == torch.uint8
    _assert_same_episodes(older.sample(4, torch.Generator().manual_seed(3)), sample)
    floats = EpisodeBuffer(allocate_episodes(env, 4), 4)
    floats.load_state_dict(state)
    assert floats.storage.obs["players"].dtype == torch.float32
    _assert_same_episodes(floats.sample(4, torch.Generator().manual_seed(3)), sample)


def test_byte_storage_refuses_values_outside_a_byte():
    env, nets, cfg, collector, _ = _collect("hanabi/small-2p", 2)
    buf = EpisodeBuffer(collector.batch, 4, byte_observations=True)
    batch, _ = collector.collect(epsilon=1.0, seed=0)
    for field, bad in (("obs", 256.0), ("state", -1.0), ("obs", float("nan"))):
        wrong = batch.map(lambda x: x.clone())
        target = wrong.obs["players"] if field == "obs" else wrong.state
        target.view(-1)[5] = bad
        with pytest.raises(ValueError, match="byte_observations=False"):
            buf.add(wrong)
    check_bytes(torch.tensor([0.0, 1.0, 255.0]), "obs")
    check_bytes(torch.zeros(0), "obs")


def test_continuous_observations_stay_floats():
    env, buf, kept = _buffer_of_one_batch("mpe/simple_spread", 2)
    assert not env.byte_observations
    assert buf.storage.obs["agents"].dtype == torch.float32
    assert buf.storage.state.dtype == torch.float32
    assert torch.equal(buf.storage.obs["agents"], kept.obs["agents"].transpose(0, 1))


def test_padded_steps_do_not_change_the_loss():
    env, nets, cfg, collector, _ = _collect("smac/3m", 8)
    batch, _ = collector.collect(epsilon=1.0, seed=0)
    assert not bool(batch.filled[:-1].all())  # some battles ended before others
    target = QNetworks(env.spec, cfg.model, cfg.algo)
    for targets, double_q in (("one_step", True), ("n_step", False), ("td_lambda", True)):
        algo = C.ValueConfig(targets=targets, double_q=double_q)
        base = td_loss(nets, target, batch, algo)
        # Garbage where nothing was filled (after each final observation), and more padding.
        after_final = ~(batch.filled | torch.cat([batch.filled[:1] & False, batch.filled[:-1]]))
        noisy = batch.map(lambda x: x.clone())
        g = torch.Generator().manual_seed(1)
        noise = torch.randn(noisy.obs["allies"].shape, generator=g) * 100
        noisy.obs["allies"] += noise * after_final[..., None, None]
        noisy.state += torch.randn(noisy.state.shape, generator=g) * after_final[..., None]
        noisy.reward += torch.randn(noisy.reward.shape, generator=g) * after_final
        longer = noisy.map(lambda x: torch.cat([x, x[-3:]]))
        longer.filled[-3:] = False
        longer.terminated[-3:] = False
        longer.truncated[-3:] = False
        for other in (noisy, longer):
            torch.testing.assert_close(td_loss(nets, target, other, algo).loss, base.loss)


def test_time_limit_bootstraps_only_when_asked():
    """Spread's episodes all end by the 25-step limit. With ``bootstrap_truncation`` the last
    step's target reads the final observation (PyMARL); without it the limit ends the return
    (EPyMARL, the particle-world presets), so the final observation cannot change the loss."""
    env, nets, cfg, collector, _ = _collect("mpe/simple_spread", 4)
    batch, _ = collector.collect(epsilon=1.0, seed=0)
    assert bool(batch.truncated.any()) and not bool(batch.terminated.any())
    target = QNetworks(env.spec, cfg.model, cfg.algo)
    final = batch.map(lambda x: x.clone())
    last = batch.filled.sum(0)  # index of each episode's final observation
    cols = torch.arange(final.state.shape[1])
    final.state[last, cols] += 3.0
    final.obs["agents"][last, cols] += 3.0
    for bootstrap in (True, False):
        algo = C.ValueConfig(name="qmix", bootstrap_truncation=bootstrap)
        before = td_loss(nets, target, batch, algo).loss
        after = td_loss(nets, target, final, algo).loss
        assert bool(before != after) == bootstrap
    assert C.load("mpe/simple_spread_qmix").algo.bootstrap_truncation is False
    assert C.load("lbf/8x8-2p-2f-coop_qmix").algo.bootstrap_truncation is False
    # PyMARL on SMAC never reports the limit (continuing_episode: False): a termination
    for name in ("smac/3m_qmix", "smac/3m_qmix_fast", "smac/3m_coma", "mpe/simple_spread_coma"):
        assert C.load(name).algo.bootstrap_truncation is False, name


def test_value_family_refuses_multi_head_actions():
    with pytest.raises(C.ConfigError, match="one discrete action per agent"):
        train("mpe/simple_reference", {"algo.name": "qmix", "progress": False})


# -- COMA ---------------------------------------------------------------------------------------


def test_coma_baseline_and_advantage_by_hand():
    q = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, -2.0]])
    pi = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]])
    # 0.2 * 1 + 0.3 * 2 + 0.5 * 3 = 2.3; 0.5 * 4 + 0.5 * 0 = 2.0
    torch.testing.assert_close(counterfactual_baseline(q, pi), torch.tensor([2.3, 2.0]))
    adv = coma_advantage(q, pi, torch.tensor([2, 1]))
    torch.testing.assert_close(adv, torch.tensor([3.0 - 2.3, 0.0 - 2.0]))


def test_coma_policy_mixes_epsilon_over_allowed_actions_only():
    logits = torch.tensor([[2.0, 0.0, 100.0, 0.0]])
    mask = torch.tensor([[True, True, False, True]])
    p = coma_policy(logits, mask, 0.3)
    soft = torch.softmax(torch.tensor([2.0, 0.0, 0.0]), -1)
    torch.testing.assert_close(p[0, [0, 1, 3]], 0.7 * soft + 0.1)
    assert float(p[0, 2]) == 0.0
    torch.testing.assert_close(p.sum(-1), torch.ones(1))


def test_comas_exploration_mixes_the_softmax_over_all_actions_as_pymarls():
    # PyMARL's COMA (mask_before_softmax: False): softmax over all actions, plus epsilon / A
    # each, then the allowed actions' share renormalised; greedy, it is the masked softmax.
    logits = torch.tensor([[2.0, 0.0, 100.0, 0.0]])
    mask = torch.tensor([[True, True, False, True]])
    p = coma_policy(logits, mask, 0.3, mask_before_softmax=False)
    mixed = 0.7 * torch.softmax(logits[0], -1) + 0.3 / 4
    expected = mixed * mask[0] / (mixed * mask[0]).sum()
    torch.testing.assert_close(p[0], expected)
    assert float(p[0, 2]) == 0.0 and float(p[0, 1]) > 0.3  # (the masked favourite's share)
    mild = torch.tensor([[2.0, 0.0, 3.0, 0.5]])
    greedy = coma_policy(mild, mask, 0.0, mask_before_softmax=False)
    torch.testing.assert_close(greedy, coma_policy(mild, mask, 0.0))
    assert C.load("smac/3m_coma").algo.mask_before_softmax is False


def test_coma_samples_the_actions_torch_multinomial_draws():
    # (drawn by exponential races on the device, without multinomial's host-side checks; the
    # same draws keep older runs' checkpoints resuming to the same actions)
    from mappo.nn.coma import ComaNetworks

    cfg = C.load("mpe/simple_spread_coma")
    env = mappo.envs.make("mpe/simple_spread", num_envs=64)
    nets = ComaNetworks(env.spec, cfg.model, cfg.algo)
    obs = env.reset(seed=3).obs["agents"]
    state = nets.acting_states(64, obs.device)["agents"]
    starts = torch.ones(64, dtype=torch.bool)
    mask = torch.rand(64, 3, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    with torch.no_grad():
        acted = nets.act_group(
            "agents", obs, state, starts, mask, False, torch.Generator().manual_seed(7)
        )
        logits, _ = nets.step_agent("agents", obs, state, starts)
    probs = coma_policy(logits, mask, nets.explore_epsilon).reshape(-1, 5)
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(acted.actions.reshape(-1), drawn.reshape(-1))
    assert bool(mask.reshape(-1, 5).gather(1, drawn).all())
    # NaN observations (a broken env): the actions are still allowed ones, so the env takes
    # them and the run's NaN check names the env (multinomial raised a traceback here)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(8)
        acted = nets.act_group("agents", obs * torch.nan, state, starts, mask, False, gen)
    assert bool(mask.gather(-1, acted.actions).all())


def test_coma_critic_sees_the_others_actions_but_not_its_own():
    env = mappo.envs.make("mpe/simple_spread", num_envs=1)
    critic = ComaCritic(env.spec, hidden=8)
    state, obs = torch.randn(2, 1, 54), torch.randn(2, 1, 3, 18)
    a = torch.tensor([[[1, 2, 3]], [[0, 0, 0]]])
    b = a.clone()
    b[0, 0, 0] = 4  # only agent 0's own action changes at step 0
    xa, xb = critic.inputs(state, obs, a), critic.inputs(state, obs, b)
    assert torch.equal(xa[0, 0, 0], xb[0, 0, 0])  # agent 0's input ignores its own action
    assert not torch.equal(xa[0, 0, 1], xb[0, 0, 1])  # agent 1 sees it
    assert not torch.equal(xa[1, 0, 0], xb[1, 0, 0])  # and so does everyone, as the last action


def test_final_step_mask_marks_the_index_after_each_end():
    ends = torch.tensor([[False, False], [True, False], [False, True], [False, False]])
    assert final_step_mask(ends).tolist() == [
        [False, False],
        [False, False],
        [True, False],
        [
            False,
            True,
        ],
    ]


def test_coma_refuses_more_than_one_group():
    with pytest.raises(C.ConfigError, match="one group"):
        train("mpe/simple_speaker_listener", {"algo.name": "coma", "progress": False})


# -- config --------------------------------------------------------------------------------------


def test_algo_name_switches_the_family_and_checks_its_keys():
    cfg = C.load("mpe/simple_spread", ["algo.name=vdn", "algo.lr=0.001"])
    assert isinstance(cfg.algo, C.ValueConfig) and cfg.algo_name == "vdn"
    assert C.from_dict(C.to_dict(cfg)).algo == cfg.algo
    with pytest.raises(C.ConfigError, match="belongs to algo.name=mappo"):
        C.load("mpe/simple_spread", ["algo.name=qmix", "algo.epochs=3"])
    with pytest.raises(C.ConfigError, match="did you mean 'algo.mixing_embed_dim'"):
        C.load("smac/3m_qmix", ["algo.mixing_embd_dim=3"])
    with pytest.raises(C.ConfigError, match="belongs to algo.name=iql/vdn/qmix"):
        C.load("mpe/simple_spread", ["algo.td_lambda=0.5"])
    with pytest.raises(C.ConfigError, match="algo.batch_size"):
        C.load("smac/3m_qmix", ["algo.batch_size=64", "algo.buffer_size=32"])


def test_every_value_preset_loads():
    names = [p for p in C.list_presets() if p.rsplit("_", 1)[-1] in ("qmix", "vdn", "iql", "coma")]
    assert "smac/3m_qmix" in names and "mpe/simple_spread_vdn" in names
    for name in names:
        cfg = C.load(name)
        assert cfg.algo_name == name.rsplit("_", 1)[-1]


# -- end to end ----------------------------------------------------------------------------------

TINY = {
    "env.num_envs": 4,
    "total_env_steps": 4 * 25 * 6,
    "algo.batch_size": 4,
    "algo.buffer_size": 16,
    "algo.updates_per_iteration": 1,
    "algo.target_update_interval": 8,
    "eval_episodes": 4,
    "eval_interval": 3,
    "log_interval": 1,
    "checkpoint_interval": 2,
    "progress": False,
    "threads": 1,
}


@pytest.mark.parametrize(
    "algo,targets",
    [
        ("iql", "one_step"),
        ("iql", "td_lambda"),
        ("vdn", "one_step"),
        ("vdn", "n_step"),
        ("qmix", "one_step"),
        ("qmix", "td_lambda"),
        ("coma", None),
    ],
)
def test_each_method_trains_evaluates_and_loads(tmp_path, algo, targets):
    over = {**TINY, "algo.name": algo, "algo.targets": targets, "run_dir": str(tmp_path)}
    if algo == "coma":
        over = {k: v for k, v in over.items() if not k.startswith("algo.")} | {
            "algo.name": "coma",
            "algo.target_update_interval": 20,
        }
    run = train("smac/3m_qmix", over)
    assert run.dir.parent == tmp_path / "smac/3m_qmix" / algo
    rows = list(csv.DictReader((run.dir / "metrics.csv").open()))
    last = rows[-1]
    keys = ("epsilon", "loss/q_taken_mean", "loss/target_mean")
    if algo == "coma":
        keys += ("loss/critic_loss", "loss/actor_grad_norm", "loss/advantage_mean")
    else:
        keys += ("buffer_fill", "loss/td_error_abs", "loss/grad_norm")
    assert all(key in last for key in keys)
    # the forms a sweep spec's metric is checked against before any trial trains
    assert [c for c in last if not is_column_name(c)] == []
    assert run.summary["env_steps"] >= 600
    assert "eval_battle_won" in run.summary
    policy = mappo.load_policy(run.dir)
    env = mappo.envs.make("smac/3m", num_envs=2, seed=0)
    step = env.reset()
    actions = policy.act(step)
    env.step(actions)  # checked against the masks by the env


def test_soft_targets_and_standardised_rewards_run(tmp_path):
    hard = "algo.target_update_interval"  # (refused beside target_tau, which replaces it)
    over = {
        **{k: v for k, v in TINY.items() if k != hard},
        "algo.name": "qmix",
        "algo.target_tau": 0.01,
        "algo.standardise_rewards": True,
        "algo.optimizer": "adam",
        "algo.targets": "n_step",
        "run_dir": str(tmp_path),
    }
    run = train("mpe/simple_spread_qmix", over)
    assert run.summary["env_steps"] == 600


VD_RESUME = {**TINY, "algo.targets": "td_lambda", "algo.standardise_rewards": True}


@pytest.mark.parametrize("preset", ["mpe/simple_spread_qmix", "mpe/simple_spread_coma"])
def test_agents_act_on_an_envs_byte_observations_alone(tmp_path, preset):
    """Hanabi returns its observations as bytes; agents whose input is the observation alone
    (no last action, no agent id) read them as floats, and the run trains."""
    over = dict(TINY)
    if preset.endswith("coma"):  # COMA has no replay buffer or target interval
        over = {k: v for k, v in over.items() if not k.startswith("algo.")}
    over |= {"env.name": "hanabi/very-small-2p", "algo.last_action": False, "model.agent_id": False}
    with make("hanabi/very-small-2p", num_envs=1) as env:
        assert env.reset().obs["players"].dtype == torch.uint8
    run = train(preset, {**over, "run_dir": str(tmp_path)})
    assert math.isfinite(run.summary["eval_return_mean"])


@pytest.mark.parametrize("env_name", ["mpe/simple_spread", "hanabi/very-small-2p"])
def test_value_resume_equals_uninterrupted(tmp_path, env_name):
    """Also with Hanabi, whose buffer (in the checkpoints) holds its observations as bytes."""
    over = {**VD_RESUME, "env.name": env_name}
    full = train("mpe/simple_spread_qmix", {**over, "run_dir": str(tmp_path / "a")})
    part = train("mpe/simple_spread_qmix", {**over, "run_dir": str(tmp_path / "b")})
    # Resume from the earliest periodic checkpoint kept (iteration 2 of 6 with the particle
    # world's 25-step episodes; Hanabi's shorter games take more iterations).
    first, *later = sorted((part.dir / "checkpoints").glob("iter_*.pt"))
    assert later
    for p in later:
        p.unlink()
    stored = load_checkpoint(first)["learner"]["buffer"]["episodes"]["obs"]
    want = torch.uint8 if env_name.startswith("hanabi") else torch.float32
    assert {t.dtype for t in stored.values()} == {want}
    resumed = resume(part.dir)
    a, b = full.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]


def test_value_run_killed_mid_run_resumes_to_the_same_parameters(tmp_path):
    over = {**VD_RESUME, "total_env_steps": 4 * 25 * 10}
    ref = train("mpe/simple_spread_qmix", {**over, "run_dir": str(tmp_path / "a")})
    run_dir = tmp_path / "b"
    args = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in over.items()]
    cmd = [sys.executable, "-m", "mappo.cli", "train", "mpe/simple_spread_qmix", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*cmd, f"run_dir={run_dir}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(run_dir.rglob("iter_00000002.pt")):
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (d,) = {p.parent.parent for p in run_dir.rglob("checkpoints/iter_*.pt")}
    done = subprocess.run(
        [sys.executable, "-m", "mappo.cli", "train", "--resume", str(d)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    final = load_checkpoint(latest_checkpoint(d))
    assert final["progress"]["iteration"] == 10
    for k, v in ref.policy.state_dict().items():
        torch.testing.assert_close(final["learner"]["policy"][k], v, rtol=0, atol=0)


def test_coma_resume_equals_uninterrupted(tmp_path):
    over = {"algo.name": "coma", "env.num_envs": 4, "total_env_steps": 4 * 25 * 6}
    over |= {k: v for k, v in TINY.items() if not k.startswith(("algo.", "env.", "total"))}
    full = train("mpe/simple_spread_qmix", {**over, "run_dir": str(tmp_path / "a")})
    part = train("mpe/simple_spread_qmix", {**over, "run_dir": str(tmp_path / "b")})
    for p in sorted((part.dir / "checkpoints").glob("iter_*.pt")):
        if p.name > "iter_00000002.pt":
            p.unlink()
    resumed = resume(part.dir)
    a, b = full.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_periodic_checkpoints_can_leave_the_buffer_out(tmp_path):
    over = {**TINY, "algo.buffer_in_checkpoints": False, "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_qmix", over)
    ckpts = sorted((run.dir / "checkpoints").glob("iter_*.pt"))
    assert load_checkpoint(ckpts[0])["learner"]["buffer"] is None
    assert load_checkpoint(ckpts[-1])["learner"]["buffer"]["size"] == 16  # the final one has it
    # from a checkpoint without it, the resume says that its buffer starts empty
    early = tmp_path / "early"
    shutil.copytree(run.dir, early)
    for p in (early / "checkpoints").glob("iter_*.pt"):
        if p.name > ckpts[0].name:
            p.unlink()
    (early / "summary.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="the checkpoint holds no replay buffer"):
        resume(early)
    resumed = resume(run.dir, {"total_env_steps": 800})
    assert resumed.summary["env_steps"] == 800


def test_cli_eval_with_gif_and_bench(tmp_path, capsys):
    run = train("mpe/simple_spread_vdn", {**TINY, "run_dir": str(tmp_path)})
    gif = tmp_path / "ep.gif"
    assert main(["eval", str(run.dir), "--episodes", "4", "--gif", str(gif), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algo"] == "vdn" and gif.stat().st_size > 0
    argv = ["bench", "train", "smac/3m_qmix", "algo.batch_size=24", "--iterations", "2"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == "qmix" and report["steps_per_second"] > 0
    assert 0 < report["env_share"] < 1
    # The warm-up goes on until the buffer holds a batch (8 episodes an iteration), so that
    # the timed iterations learn rather than only play.
    assert report["warmup_iterations"] == 3


def test_resume_refuses_keys_the_checkpoint_depends_on(tmp_path, capsys):
    run = train("mpe/simple_spread_qmix", {**TINY, "run_dir": str(tmp_path)})
    for bad in ("seed=7", "model.hidden_sizes=[32]", "env.num_envs=8", "algo.name=vdn"):
        assert main(["train", "--resume", str(run.dir), bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mappo: error: config field") and "cannot change" in err
        assert "\n" not in err
    # A larger budget is fine.
    assert main(["train", "--resume", str(run.dir), "total_env_steps=700"]) == 0


def test_value_config_cross_checks():
    with pytest.raises(C.ConfigError, match="at least one iteration's episodes"):
        C.load("smac/3m_qmix", ["env.num_envs=64", "algo.buffer_size=32", "algo.batch_size=8"])
    cfg = C.TrainConfig(algo=C.AlgoConfig(name="qmix"))
    with pytest.raises(C.ConfigError, match="ValueConfig"):
        C.check(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.n_step=5"], "'algo.n_step' is read with algo.targets=n_step only"),
        (["algo.td_lambda=0.3"], "'algo.td_lambda' is read with algo.targets=td_lambda only"),
        (
            ["algo.target_tau=0.01", "algo.target_update_interval=50"],
            "'algo.target_update_interval' times hard target copies, which algo.target_tau",
        ),
        (["algo.optimizer=adam", "algo.optim_alpha=0.5"], "'algo.optim_alpha' is RMSprop's"),
        (["rollout_length=50"], "'rollout_length' is read by algo.name=mappo only"),
        (["model.policy_gain=0.5"], "'model.policy_gain' is read by algo.name=mappo only"),
        (["algo.name=coma", "model.log_std_init=-1"], "coma acts in discrete action spaces"),
    ],
)
def test_options_the_value_family_never_reads_are_refused(overrides, message):
    """An option the run would never read trains as if it were absent, while its folder and
    the reports list it as a difference between runs: the command line's are refused."""
    with pytest.raises(C.ConfigError, match=message.replace("(", "\\(")):
        C.load("smac/3m_qmix", overrides)
    # What they are read with passes, and so do a MAPPO preset's own values under QMIX (the
    # Hanabi preset sets rollout_length and policy_gain).
    C.load("smac/3m_qmix", ["algo.targets=n_step", "algo.n_step=5", "algo.optim_alpha=0.9"])
    C.load("smac/3m_qmix", ["algo.target_tau=0.01"])
    C.load("hanabi/full-2p", ["algo.name=vdn"])


def test_a_short_3m_qmix_run_learns_to_win(tmp_path):
    common = {"eval_episodes": 64, "eval_interval": 0, "threads": 1, "progress": False}
    before = train(
        "smac/3m_qmix_fast", {**common, "total_env_steps": 1, "run_dir": str(tmp_path / "a")}
    )
    after = train(
        "smac/3m_qmix_fast", {**common, "total_env_steps": 20_000, "run_dir": str(tmp_path / "b")}
    )
    assert after.summary["eval_battle_won"] >= before.summary["eval_battle_won"] + 0.2


def test_resume_refuses_a_new_mixer_or_optimiser_before_writing(tmp_path, capsys):
    """The mixer's sizes and the optimiser shape the checkpoint's state (a torch error inside
    load_state_dict or the optimiser's step, after config.yaml had been rewritten): refused in
    one line with nothing written."""
    run = train("mpe/simple_spread_qmix", {**TINY, "run_dir": str(tmp_path)})
    saved = {p: p.read_bytes() for p in run.dir.rglob("*") if p.is_file() and p.name != ".lock"}
    changes = ("algo.mixing_embed_dim=16", "algo.hypernet_layers=1", "algo.hypernet_embed=32")
    for bad in (*changes, "algo.optimizer=rmsprop"):
        assert main(["train", "--resume", str(run.dir), bad, "total_env_steps=700"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"mappo: error: config field '{bad.split('=')[0]}' cannot change")
        assert "\n" not in err
    now = {p: p.read_bytes() for p in run.dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert now == saved


def test_a_value_algorithm_over_a_mappo_preset_names_its_own_preset() -> None:
    """smac/3m_fast with algo.name=qmix keeps 64 envs and no GRU; smac/3m_qmix has PyMARL's."""
    from mappo.trainer import _warn_new_run

    with pytest.warns(UserWarning, match="over smac/3m_fast keeps that preset's env and model"):
        _warn_new_run(C.load("smac/3m_fast", ["algo.name=qmix"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_new_run(C.load("smac/3m_qmix"))  # the algorithm's own preset: nothing to say
        _warn_new_run(C.load("mpe/simple_spread"))  # (mpe/simple_spread_mappo is MAPPO's too)
        _warn_new_run(C.load("smac/3m_qmix_fast"))  # a QMIX preset of its own
        _warn_new_run(C.load("lbf/8x8-2p-2f-coop_vdn"))
    # an env named by its gymnasium id: the algorithm's preset is named after the preset
    with pytest.warns(UserWarning, match="lbf/8x8-2p-2f-coop_vdn holds vdn's own for this task"):
        _warn_new_run(C.load("lbf/8x8-2p-2f-coop", ["algo.name=vdn"]))


def test_a_value_run_out_of_memory_is_told_to_lower_its_buffer(tmp_path, capsys, monkeypatch):
    # (the replay buffer holds most of a value method's memory; the advice named the envs)
    from mappo.cli import main
    from mappo.learners.ppo import PPOLearner
    from mappo.learners.value import ValueLearner

    def allocation_failure(self, iteration, env_steps):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 3 GB")

    monkeypatch.setattr(ValueLearner, "iterate", allocation_failure)
    monkeypatch.setattr(PPOLearner, "iterate", allocation_failure)
    argv = ["train", "mpe/simple_spread_qmix", "progress=false", f"run_dir={tmp_path}"]
    assert main(argv) == 2
    assert "lower algo.buffer_size" in capsys.readouterr().err
    assert main(["train", "mpe/simple_spread_fast", "progress=false", f"run_dir={tmp_path}"]) == 2
    assert "lower env.num_envs or eval_episodes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env_name,warned",
    [
        ("pettingzoo:mpe2.simple_tag_v3", True),
        ("pettingzoo:mpe2.simple_speaker_listener_v4", False),
    ],
)
def test_groups_of_different_rewards_are_named_once(tmp_path, env_name, warned):
    """The value family's one team reward mixes the groups' rewards: opposing groups (tag's
    adversaries and prey) are told of once; groups that share their reward (speaker and
    listener) are not."""
    pytest.importorskip("mpe2")
    over = {
        **TINY,
        "algo.name": "qmix",
        "env.name": env_name,
        "env.kwargs.num_workers": 0,
        "total_env_steps": 4 * 25 * 3,
        "run_dir": str(tmp_path),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train("pettingzoo/simple_spread", over)
    told = [w for w in caught if "get different rewards" in str(w.message)]
    assert len(told) == (1 if warned else 0)
    if warned:
        assert "'adversary', 'agent'" in str(told[0].message)


def test_the_group_reward_gap_counts_only_agents_alive_when_they_acted():
    """A dead agent's zero reward is not its group's view of the step, nor is a group with no
    living agent, nor an env whose episode has ended: only living groups' means are compared."""
    from mappo.episodes import _group_reward_gap

    reward = {
        "a": torch.tensor([[1.0], [1.0], [5.0], [2.0]]),
        "b": torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
    }
    alive = {
        "a": torch.tensor([[True], [True], [True], [True]]),
        "b": torch.tensor([[True, False], [False, False], [True, True], [True, True]]),
    }
    active = torch.tensor([True, True, False, True])
    assert float(_group_reward_gap(reward, alive, active)) == 2.0  # env 3 only
    active[3] = False
    assert float(_group_reward_gap(reward, alive, active)) == 0.0


def test_runs_of_different_seeds_collect_different_episodes():
    """torch's CPU generator keeps only a seed's low 32 bits: the run seed must reach them, or
    every run plays the same episodes at the same iteration (it did, with the run seed in the
    high bits alone)."""
    from mappo.episodes import collection_seed

    seeds = {collection_seed(s, i) % 2**32 for s in range(200) for i in range(500)}
    assert len(seeds) == 200 * 500 and min(seeds) >= 2**31
    with make("mpe/simple_spread", num_envs=4) as env:
        first = env.reset(seed=collection_seed(1, 0)).obs["agents"]
        other = env.reset(seed=collection_seed(2, 0)).obs["agents"]
        again = env.reset(seed=collection_seed(1, 0)).obs["agents"]
    assert not torch.equal(first, other)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
