"""MADDPG for discrete actions: the Gumbel-softmax sample, the critic's targets, the actors'
loss, and runs end to end (train, evaluate, load, resume)."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import mappo
from mappo import config as C
from mappo.algos.maddpg import actor_loss, critic_loss, gumbel_softmax_sample, update
from mappo.cli import main
from mappo.data import ActionSpec, EnvSpec, EpisodeBatch, GroupSpec
from mappo.envs import make
from mappo.nn.maddpg import MaddpgNetworks
from mappo.trainer import load_checkpoint, resume, train

sys.path.insert(0, str(Path(__file__).parent))
from toy_env import register_toy  # noqa: E402

register_toy()

TINY = {
    "env.num_envs": 4,
    "total_env_steps": 4 * 25 * 6,
    "algo.batch_size": 4,
    "algo.buffer_size": 16,
    "algo.updates_per_iteration": 2,
    "eval_episodes": 4,
    "eval_interval": 3,
    "log_interval": 1,
    "checkpoint_interval": 2,
    "progress": False,
    "threads": 1,
}


# -- the Gumbel-softmax sample -------------------------------------------------------------------


def test_gumbel_sample_is_one_hot_with_the_softmax_frequencies_and_its_gradient():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0]).repeat(40_000, 1).requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    sample = gumbel_softmax_sample(logits, None, 1.0, gen)
    hard = torch.nn.functional.one_hot(sample.detach().argmax(-1), 4).float()
    torch.testing.assert_close(sample.detach(), hard)  # (to rounding: hard + soft - soft)
    freq = sample.detach().mean(0)
    torch.testing.assert_close(freq, torch.softmax(logits[0].detach(), -1), atol=0.01, rtol=0)
    # the gradient is the relaxed softmax's at the same noise: replay the noise to compare
    weights = torch.randn(4)
    (sample * weights).sum().backward()
    replay = torch.Generator().manual_seed(0)
    noise = -torch.empty_like(logits).exponential_(1, generator=replay).log()
    leaf = logits.detach().clone().requires_grad_(True)
    soft = torch.softmax(leaf + noise, -1)
    (soft * weights).sum().backward()
    torch.testing.assert_close(logits.grad, leaf.grad)


def test_gumbel_sample_never_takes_a_masked_action():
    logits = torch.tensor([5.0, 0.0, 9.0]).repeat(5_000, 1)
    mask = torch.tensor([False, True, False]).repeat(5_000, 1)
    mask[::2, 0] = True
    sample = gumbel_softmax_sample(logits, mask, 0.5, torch.Generator().manual_seed(1))
    assert bool((sample[~mask].abs() < 1e-6).all())
    assert sample[::2, 0].mean() > 0.9  # where allowed, the 5.0 logit wins most draws


# -- the losses on a hand-made batch --------------------------------------------------------------


def _spread_networks(**algo: object) -> tuple[MaddpgNetworks, C.TrainConfig]:
    cfg = C.load("mpe/simple_spread_maddpg", {f"algo.{k}": v for k, v in algo.items()})
    with make("mpe/simple_spread", num_envs=1) as env:
        spec = env.spec
    torch.manual_seed(0)
    return MaddpgNetworks(spec, cfg.model, cfg.algo), cfg


def _batch(T: int = 3, B: int = 2, ends_at: int = 2) -> EpisodeBatch:
    """An episode batch of Spread's shapes: ``ends_at + 1`` steps filled, the last by a time
    limit (truncated), random observations, states, rewards and actions."""
    gen = torch.Generator().manual_seed(3)
    L = T + 1
    filled = torch.zeros(L, B, dtype=torch.bool)
    filled[: ends_at + 1] = True
    truncated = torch.zeros(L, B, dtype=torch.bool)
    truncated[ends_at] = True
    return EpisodeBatch(
        obs={"agents": torch.randn(L, B, 3, 18, generator=gen)},
        action_mask={},
        alive={"agents": torch.ones(L, B, 3, dtype=torch.bool)},
        actions={"agents": torch.randint(0, 5, (L, B, 3, 1), generator=gen)},
        state=torch.randn(L, B, 54, generator=gen),
        reward=torch.randn(L, B, generator=gen),
        terminated=torch.zeros(L, B, dtype=torch.bool),
        truncated=truncated,
        filled=filled,
    )


@pytest.mark.parametrize("bootstrap", [True, False])
def test_critic_targets_by_hand(bootstrap):
    nets, cfg = _spread_networks(bootstrap_truncation=bootstrap, standardise_rewards=False)
    target = MaddpgNetworks(nets.spec, cfg.model, cfg.algo)  # other weights than the online's
    b = _batch()
    terms = critic_loss(nets, target, b, cfg.algo)
    with torch.no_grad():
        greedy = target.unroll(b.obs, b.actions)["agents"].argmax(-1)  # [L, B, 3]
        joint = torch.nn.functional.one_hot(greedy, 5).float().flatten(-2)
        next_q = target.critic(b.state, joint)[1:]
        stored = torch.nn.functional.one_hot(b.actions["agents"][..., 0], 5).float().flatten(-2)
        q = nets.critic(b.state, stored)[:-1]
    gamma = cfg.algo.gamma
    y = b.reward[:-1] + gamma * next_q
    y[2] = b.reward[2] + (gamma * next_q[2] if bootstrap else 0.0)  # the time limit's step
    expected = ((q[:3] - y[:3]) ** 2).mean()  # step 3 is padding: no weight
    torch.testing.assert_close(terms["loss"], expected)
    torch.testing.assert_close(terms["target_mean"], y[:3].mean())


def test_each_actor_row_replaces_only_its_own_action_and_trains_only_the_actors():
    nets, cfg = _spread_networks()
    b = _batch()
    seen = []
    forward = nets.critic.forward

    def recording(state, joint):
        seen.append(joint.detach().clone())
        return forward(state, joint)

    nets.critic.forward = recording  # type: ignore[method-assign]
    nets.critic.requires_grad_(False)
    loss = actor_loss(nets, b, cfg.algo, torch.Generator().manual_seed(0))
    loss.backward()
    (joint,) = seen  # [T, B, n, W]: row i is agent i's replacement
    stored = torch.nn.functional.one_hot(b.actions["agents"][:-1, ..., 0], 5).float()
    blocks = joint.unflatten(-1, (3, 5))  # [T, B, n, n, A]
    for i in range(3):
        others = [j for j in range(3) if j != i]
        torch.testing.assert_close(blocks[:, :, i, others], stored[:, :, others])
        own = blocks[:, :, i, i]  # a one-hot sample of its own (to rounding)
        torch.testing.assert_close(own, torch.nn.functional.one_hot(own.argmax(-1), 5).float())
    assert all(p.grad is None for p in nets.critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in nets.agents.parameters())


def test_dead_agents_and_padding_carry_no_actor_loss():
    nets, cfg = _spread_networks()
    b = _batch()
    b.alive["agents"][:, :, 1] = False  # agent 1 is dead throughout
    gen_state = torch.Generator().manual_seed(0)
    loss = actor_loss(nets, b, cfg.algo, gen_state)
    # the same loss by hand: the rows of alive agents at filled steps
    nets2 = nets
    calls = []
    forward = nets2.critic.forward

    def keep(state, joint):
        q = forward(state, joint)
        calls.append(q)
        return q

    nets2.critic.forward = keep  # type: ignore[method-assign]
    actor_loss(nets2, b, cfg.algo, torch.Generator().manual_seed(0))
    (q,) = calls  # [T, B, n]
    want = -q[:3][:, :, [0, 2]].mean()
    torch.testing.assert_close(loss, want)


def test_one_update_moves_the_targets_by_tau():
    nets, cfg = _spread_networks()
    target = MaddpgNetworks(nets.spec, cfg.model, cfg.algo)
    target.load_state_dict(nets.state_dict())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    actor = torch.optim.Adam(nets.agents.parameters(), lr=1e-2)
    critic = torch.optim.Adam(nets.critic.parameters(), lr=1e-2)
    out = update(nets, target, _batch(), actor, critic, cfg.algo, torch.Generator())
    assert {"critic_loss", "actor_loss", "critic_grad_norm", "actor_grad_norm"} <= set(out)
    tau = cfg.algo.target_tau
    for k, v in target.state_dict().items():
        online = nets.state_dict()[k]
        torch.testing.assert_close(v, before[k] + tau * (online - before[k]))
    assert any(not torch.equal(v, before[k]) for k, v in target.state_dict().items())


# -- config --------------------------------------------------------------------------------------


def test_maddpg_config_keys_and_refusals():
    cfg = C.load("mpe/simple_spread", ["algo.name=maddpg", "algo.target_tau=0.01"])
    assert isinstance(cfg.algo, C.MaddpgConfig) and cfg.family == "maddpg"
    assert cfg.algo_name == "maddpg" and cfg.algo.target_tau == 0.01
    assert C.from_dict(C.to_dict(cfg)).algo == cfg.algo
    with pytest.raises(C.ConfigError, match="belongs to algo.name=mappo"):
        C.load("mpe/simple_spread_maddpg", ["algo.epochs=3"])
    with pytest.raises(C.ConfigError, match="algo.batch_size"):
        C.load("mpe/simple_spread_maddpg", ["algo.batch_size=400", "algo.buffer_size=300"])
    with pytest.raises(C.ConfigError, match="num_seeds"):
        C.load("mpe/simple_spread_maddpg", ["num_seeds=2"])
    with pytest.raises(C.ConfigError, match="compile"):
        C.load("mpe/simple_spread_maddpg", ["compile=on"])


def test_maddpg_reads_the_policy_gain_but_not_the_gaussian_policys_keys():
    cfg = C.load("mpe/simple_spread_maddpg", ["model.policy_gain=0.5"])
    nets = MaddpgNetworks(_spread_networks()[0].spec, cfg.model, cfg.algo)
    head = nets.agents["agents"].head.weight[0]  # [in, A], orthogonal columns of norm 0.5
    torch.testing.assert_close(head.T @ head, 0.25 * torch.eye(5), atol=1e-5, rtol=0)
    with pytest.raises(C.ConfigError, match="maddpg acts deterministically in a box"):
        C.load("mpe/simple_spread_continuous_maddpg", ["model.log_std_init=-1"])
    with pytest.raises(C.ConfigError, match="'rollout_length' is read by algo.name=mappo"):
        C.load("mpe/simple_spread_maddpg", ["rollout_length=50"])


def test_untrained_actors_start_near_uniform():
    """The actors' output layers start at the policy gain (0.01), as the off-policy code's:
    the first episodes explore every action."""
    nets, _ = _spread_networks()
    logits = nets.unroll(_batch().obs, _batch().actions)["agents"]
    assert float(torch.softmax(logits, -1).max()) < 0.3  # 5 actions: uniform is 0.2


def test_cli_refuses_a_bad_maddpg_key_with_one_line(capsys, tmp_path):
    argv = ["train", "mpe/simple_spread_maddpg", "algo.target_tau=2", f"run_dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "algo.target_tau" in err and "\n" not in err


# -- end to end ----------------------------------------------------------------------------------


def test_maddpg_trains_evaluates_and_loads(tmp_path, capsys):
    run = train("mpe/simple_spread_maddpg", {**TINY, "run_dir": str(tmp_path)})
    assert run.dir.parent == tmp_path / "mpe/simple_spread_maddpg" / "maddpg"
    last = list(csv.DictReader((run.dir / "metrics.csv").open()))[-1]
    for key in ("epsilon", "buffer_fill", "loss/critic_loss", "loss/actor_loss"):
        assert math.isfinite(float(last[key])), key
    assert run.summary["env_steps"] == 600 and math.isfinite(run.summary["eval_return_mean"])
    policy = mappo.load_policy(run.dir)
    with make("mpe/simple_spread", num_envs=2, seed=0) as env:
        step = env.reset()
        env.step(policy.act(step))
    assert main(["eval", str(run.dir), "--episodes", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["algo"] == "maddpg"


def test_maddpg_with_two_groups_and_a_recurrent_actor(tmp_path):
    """Speaker and listener (two groups, other action sizes) through one joint critic; the
    actors with a GRU and the previous action (R-MADDPG's actor) unroll over whole episodes."""
    over = {**TINY, "env.name": "mpe/simple_speaker_listener", "model.recurrent": "gru"}
    over |= {"algo.last_action": True, "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_maddpg", over)
    assert math.isfinite(run.summary["eval_return_mean"])
    assert run.policy.critic.width == 3 + 5  # the speaker's 3 words, the listener's 5 moves


def test_maddpg_with_two_action_heads(tmp_path):
    """Reference: each agent moves (5) and says a word (10) at once; the critic reads both heads'
    one-hots, each head is sampled and relaxed on its own."""
    over = {**TINY, "env.name": "mpe/simple_reference", "algo.last_action": True}
    run = train("mpe/simple_spread_maddpg", {**over, "run_dir": str(tmp_path)})
    assert run.policy.critic.width == 2 * (5 + 10)
    stored = torch.tensor([[[3, 7], [0, 9]]])  # [1, n, k]
    features = run.policy.action_features("agents", stored)
    assert features.shape == (1, 2, 15)
    assert features[0, 0].nonzero().flatten().tolist() == [3, 5 + 7]
    policy = mappo.load_policy(run.dir)
    with make("mpe/simple_reference", num_envs=3) as env:
        actions = policy.act(env.reset())
        assert actions["agents"].shape == (3, 2, 2)
        env.step(actions)
    nets = run.policy
    logits = torch.randn(4000, 2, 15, requires_grad=True)
    parts = nets.heads("agents", logits, None)
    assert [p[0].shape[-1] for p in parts] == [5, 10]
    from mappo.algos.maddpg import gumbel_softmax_sample

    sample = torch.cat([gumbel_softmax_sample(h, m, 1.0, None) for h, m in parts], -1)
    torch.testing.assert_close(sample.detach().sum(-1), torch.full((4000, 2), 2.0))


def resume_equals_uninterrupted(over: dict, tmp_path: Path) -> None:
    """A run resumed from its first checkpoint (the later ones removed) ends with the same
    parameters and final evaluation as one never interrupted."""
    full = train("mpe/simple_spread_maddpg", {**over, "run_dir": str(tmp_path / "a")})
    part = train("mpe/simple_spread_maddpg", {**over, "run_dir": str(tmp_path / "b")})
    first, *later = sorted((part.dir / "checkpoints").glob("iter_*.pt"))
    assert later and load_checkpoint(first)["learner"]["buffer"] is not None
    for p in later:
        p.unlink()
    resumed = resume(part.dir)
    a, b = full.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]


def test_maddpg_resume_equals_uninterrupted(tmp_path):
    resume_equals_uninterrupted({**TINY, "algo.standardise_rewards": True}, tmp_path)


def test_maddpg_learns_the_toy_task_with_masks_and_deaths(tmp_path):
    """Each agent is rewarded for picking the target it observes; one action is always masked
    and the last agent dies after step 2. The actors learn it through the critic alone: the
    greedy return ends far above a random policy's and the masked action is never taken."""
    kwargs = {"masks": True, "deaths": True}
    over = {**TINY, "env.name": "toy/match", "env.kwargs": kwargs, "env.num_envs": 16}
    over |= {"total_env_steps": 16 * 6 * 40, "algo.batch_size": 32, "algo.buffer_size": 256}
    over |= {"algo.updates_per_iteration": 4, "eval_episodes": 32, "eval_interval": 1000}
    over |= {"algo.epsilon_anneal_steps": 1000, "algo.actor_lr": 3e-3, "algo.critic_lr": 3e-3}
    over |= {"model.hidden_sizes": [32, 32], "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_maddpg", over)
    with make("toy/match", num_envs=1, **kwargs) as env:
        assert env.spec.episode_limit == 6
    # 2 agents x 6 steps, the second alive for 2 of them: 8 right choices at most; a random
    # choice among the 3 allowed actions is right a third of the time (2.7)
    assert run.summary["eval_return_mean"] >= 7.0


# -- actions in a box ----------------------------------------------------------------------------


def _box_networks(low: float, high: float, noise: float = 0.1) -> MaddpgNetworks:
    group = GroupSpec(("a", "b"), (3,), ActionSpec.box(low, [high, high]))
    spec = EnvSpec({"movers": group}, (6,), 5)
    cfg = C.load("mpe/simple_spread_maddpg", {"algo.action_noise": noise})
    torch.manual_seed(0)
    return MaddpgNetworks(spec, cfg.model, cfg.algo)


def test_box_actions_are_deterministic_in_minus_one_to_one_and_reach_the_env_scaled():
    nets = _box_networks(0.0, 4.0, noise=0.5)
    obs = torch.randn(64, 2, 3)
    state = nets.acting_states(64, torch.device("cpu"))["movers"]
    starts = torch.ones(64, dtype=torch.bool)
    greedy = nets.act_group("movers", obs, state, starts, None, True, None)
    again = nets.act_group("movers", obs, state, starts, None, True, None)
    torch.testing.assert_close(greedy.actions, again.actions)  # no noise when greedy
    assert greedy.actions.shape == (64, 2, 2) and greedy.actions.dtype == torch.float32
    torch.testing.assert_close(greedy.env_actions, (greedy.actions + 1.0) * 2.0)
    noisy = nets.act_group("movers", obs, state, starts, None, False, torch.Generator())
    assert not torch.equal(noisy.actions, greedy.actions)
    assert bool((noisy.actions.abs() <= 1.0).all())
    assert bool(((noisy.env_actions >= 0.0) & (noisy.env_actions <= 4.0)).all())


def test_an_unbounded_box_is_refused_with_the_fix():
    for low, high in ((-math.inf, math.inf), (-1e39, 1e39)):  # (1e39 is inf in float32)
        with pytest.raises(C.ConfigError, match="unbounded action components.*finite bounds"):
            _box_networks(low, high)


def test_bounds_near_the_float32_maximum_scale_without_overflow():
    nets = _box_networks(-3e38, 3e38)
    u = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]).reshape(5, 1, 1).expand(5, 2, 2)
    env = nets.to_env("movers", u)
    want = torch.tensor([-3e38, -1.5e38, 0.0, 1.5e38, 3e38]).reshape(5, 1, 1).expand(5, 2, 2)
    torch.testing.assert_close(env, want)


def test_maddpg_learns_to_reach_in_a_box_beside_a_discrete_group(tmp_path):
    """toy/reach: movers act in [-1, 1] toward their goals, a pointer (discrete) names the side of
    the first mover's goal; one critic reads both. The team reward is the mean of the movers' and
    the pointer's: untrained policies score -3.5 to -5.5 over the 8 steps, trained ones above 0."""
    over = {**TINY, "env.name": "toy/reach", "env.kwargs": {"mixed": True}, "env.num_envs": 16}
    over |= {"total_env_steps": 16 * 8 * 50, "algo.batch_size": 32, "algo.buffer_size": 512}
    over |= {"algo.updates_per_iteration": 8, "eval_episodes": 32, "eval_interval": 1000}
    over |= {"algo.epsilon_anneal_steps": 2000, "algo.actor_lr": 3e-3, "algo.critic_lr": 3e-3}
    over |= {"algo.last_action": True, "run_dir": str(tmp_path)}
    run = train("mpe/simple_spread_maddpg", over)
    assert run.summary["eval_return_mean"] > 0.0
    policy = mappo.load_policy(run.dir)
    with make("toy/reach", num_envs=4, mixed=True) as env:
        actions = policy.act(env.reset())
        assert actions["movers"].dtype == torch.float32 and actions["movers"].shape == (4, 2, 1)
        assert actions["pointer"].dtype == torch.int64
        env.step(actions)


def test_settings_for_another_kind_of_action_warn_that_they_do_nothing(tmp_path):
    """algo.action_noise on a discrete env (or epsilon in a box) would train as if unset: a
    sweep over it would train one run under several names."""
    over = {**TINY, "total_env_steps": 100, "run_dir": str(tmp_path)}
    with pytest.warns(UserWarning, match=r"algo.action_noise=0.3 has no effect: it acts on conti"):
        train("mpe/simple_spread_maddpg", {**over, "algo.action_noise": 0.3})
    with pytest.warns(UserWarning, match=r"algo.epsilon_finish=0.2 has no effect: it acts on disc"):
        train("mpe/simple_spread_continuous_maddpg", {**over, "algo.epsilon_finish": 0.2})
