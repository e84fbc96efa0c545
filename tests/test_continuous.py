"""Continuous actions: the Gaussian policy against closed forms, the box checks, every MAPPO
option with a continuous group, a continuous team that learns, and mixed discrete/continuous
envs through training, evaluation, resume and the PettingZoo view."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mappo import config as C
from mappo.algos.mappo import make_samples
from mappo.config import ConfigError
from mappo.data import ActionSpec
from mappo.envs.base import ActionError
from mappo.evaluation import evaluate
from mappo.nn.actor_critic import ActorCritic
from mappo.nn.distributions import DiagGaussian
from mappo.trainer import Trainer, resume, train

sys.path.insert(0, str(Path(__file__).parent))
from toy_env import ReachEnv, register_toy  # noqa: E402

register_toy()

REACH = {
    "env.name": "toy/reach",
    "env.num_envs": 32,
    "rollout_length": 16,
    "model.hidden_sizes": [32, 32],
    "model.recurrent": "none",
    "algo.epochs": 5,
    "actor_lr": 3e-3,
    "critic_lr": 3e-3,
    "eval_episodes": 32,
    "log_interval": 5,
    "progress": False,
    "threads": 1,
}


# -- the Gaussian ------------------------------------------------------------------------------
def _gaussian(bounds: str, low: float = -2.0, high: float = 3.0) -> DiagGaussian:
    mean = torch.tensor([[0.3, -1.2], [2.0, 0.0]], dtype=torch.float64)
    log_std = torch.tensor([-0.4, 0.5], dtype=torch.float64)
    box = torch.tensor([low, low], dtype=torch.float64), torch.tensor([high, high]).double()
    return DiagGaussian(mean, log_std, *box, bounds)


def test_gaussian_log_prob_and_entropy_match_the_closed_forms() -> None:
    dist = _gaussian("clip")
    normal = torch.distributions.Normal(dist.mean, dist.std)
    u = torch.tensor([[0.1, 5.0], [-3.0, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(dist.log_prob(u), normal.log_prob(u).sum(-1))
    torch.testing.assert_close(dist.entropy(), normal.entropy().sum(-1))
    # log sqrt(2 pi e) + log std per component, by hand.
    by_hand = sum(0.5 * math.log(2 * math.pi * math.e) + s for s in (-0.4, 0.5))
    torch.testing.assert_close(dist.entropy(), torch.full((2,), by_hand, dtype=torch.float64))


def test_tanh_log_prob_is_the_density_of_the_squashed_action() -> None:
    """p(a) from the change of variables equals the numerical derivative of the CDF of a, and
    integrates to 1 over the box."""
    low, high, mean, std = -2.0, 3.0, 0.3, 0.7

    def squashed(n: int) -> DiagGaussian:
        return DiagGaussian(
            torch.full((n, 1), mean, dtype=torch.float64),
            torch.tensor([math.log(std)], dtype=torch.float64),
            torch.tensor([low], dtype=torch.float64),
            torch.tensor([high], dtype=torch.float64),
            "tanh",
        )

    normal = torch.distributions.Normal(mean, std)

    def cdf(a: torch.Tensor) -> torch.Tensor:  # P(A <= a), A = low + (tanh(U) + 1)(high-low)/2
        return normal.cdf(torch.atanh(2.0 * (a - low) / (high - low) - 1.0))

    a = torch.linspace(low + 0.05, high - 0.05, 41, dtype=torch.float64)
    h = 1e-5
    numeric = (cdf(a + h) - cdf(a - h)) / (2 * h)
    u = torch.atanh(2.0 * (a - low) / (high - low) - 1.0).unsqueeze(-1)
    dist = squashed(len(a))
    torch.testing.assert_close(dist.log_prob(u).exp(), numeric, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(dist.to_env(u).squeeze(-1), a)
    # The density integrates to one over the box (trapezoid in a, on a fine grid of u).
    grid = torch.linspace(-12.0, 12.0, 200_001, dtype=torch.float64).unsqueeze(-1)
    dist = squashed(len(grid))
    p = dist.log_prob(grid).exp()
    assert float(torch.trapezoid(p, dist.to_env(grid).squeeze(-1))) == pytest.approx(1.0, abs=1e-6)


def test_tanh_log_prob_stays_finite_far_from_the_mean() -> None:
    dist = _gaussian("tanh")
    u = torch.tensor([[40.0, -40.0], [-15.0, 15.0]], dtype=torch.float64).float()
    dist32 = DiagGaussian(
        dist.mean.float(), dist.log_std.float(), dist.low.float(), dist.high.float(), "tanh"
    )
    assert torch.isfinite(dist32.log_prob(u)).all()
    a = dist32.to_env(u)
    assert bool((a >= -2.0).all() and (a <= 3.0).all())


@pytest.mark.parametrize("bounds", ["clip", "tanh"])
def test_env_actions_stay_in_the_box_and_the_mode_is_the_mean(bounds: str) -> None:
    dist = _gaussian(bounds)
    gen = torch.Generator().manual_seed(0)
    u = torch.stack([dist.sample(gen) * 10 for _ in range(200)])
    a = dist.to_env(u)
    assert bool((a >= -2.0).all() and (a <= 3.0).all())
    mode = dist.to_env(dist.mode())
    expected = dist.mean.clamp(-2, 3) if bounds == "clip" else -2 + (dist.mean.tanh() + 1) * 2.5
    torch.testing.assert_close(mode, expected)
    if bounds == "clip":  # inside the box the env gets the sample itself
        inside = (u > -2) & (u < 3)
        assert torch.equal(a[inside], u[inside])


def test_sampling_draws_only_from_its_generator() -> None:
    dist = _gaussian("clip")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    x = dist.sample(torch.Generator().manual_seed(7))
    y = dist.sample(torch.Generator().manual_seed(7))
    assert torch.equal(x, y) and torch.equal(torch.random.get_rng_state(), before)
    # Many samples: the empirical mean and std are the distribution's.
    gen = torch.Generator().manual_seed(1)
    many = torch.stack([dist.sample(gen) for _ in range(20_000)])
    torch.testing.assert_close(many.mean(0), dist.mean, atol=0.03, rtol=0)
    torch.testing.assert_close(many.std(0), dist.std.expand_as(dist.mean), atol=0.03, rtol=0)


# -- the contract's box checks ------------------------------------------------------------------
def test_box_spec_and_checks() -> None:
    assert ActionSpec.box(-1.0, [1.0, 2.0]) == ActionSpec(low=(-1.0, -1.0), high=(1.0, 2.0))
    space = ActionSpec.box([0.0], [float("inf")])
    assert space.continuous and space.num_heads == 1 and not space.bounded
    assert space.dtype == torch.float32
    with pytest.raises(ValueError, match="low must be <="):
        ActionSpec.box([1.0], [0.0])
    with pytest.raises(ValueError, match=r"the bounds hold NaN \(low=\(nan, 0.0\)"):
        ActionSpec.box([float("nan"), 0.0], 1.0)
    with pytest.raises(ValueError, match="either discrete"):
        ActionSpec((3,), low=(0.0,), high=(1.0,))

    env = ReachEnv(3, mixed=True)
    env.reset(seed=0)
    pointer = torch.zeros(3, 1, 1, dtype=torch.int64)
    ok = torch.zeros(3, 2, 1)
    env.step({"movers": ok, "pointer": pointer})
    env.step({"movers": ok[..., 0], "pointer": pointer})  # [E, n] is accepted for d = 1
    bad = {
        "outside the box": ok + 1.5,
        "not finite": torch.full((3, 2, 1), float("nan")),
        "floating dtype": ok.long(),
        r"\(num_envs, agents, components\)": torch.zeros(3, 2, 2),
    }
    for message, movers in bad.items():
        with pytest.raises(ActionError, match=message):
            env.step({"movers": movers, "pointer": pointer})
    with pytest.raises(ActionError, match="integer dtype"):
        env.step({"movers": ok, "pointer": pointer.float()})


# -- every option with a continuous group ------------------------------------------------------
@pytest.mark.parametrize(
    ("recurrent", "share", "state_std", "bounds", "critic"),
    [
        ("none", True, False, "clip", "state"),
        ("gru", True, True, "tanh", "state"),
        ("lstm", False, False, "tanh", "local"),
        ("gru", False, True, "clip", "local"),
    ],
)
def test_training_forward_reproduces_the_rollout_with_continuous_actions(
    recurrent: str, share: bool, state_std: bool, bounds: str, critic: str
) -> None:
    cfg = C.load(
        None,
        {
            **REACH,
            "env.kwargs": {"mixed": True},
            "env.num_envs": 4,
            "rollout_length": 13,
            "model.recurrent": recurrent,
            "model.share_params": share,
            "model.state_dependent_std": state_std,
            "model.action_bounds": bounds,
            "model.log_std_init": -0.5,
            "algo.critic_input": critic,
            "algo.value_norm": "popart",
            **({} if recurrent == "none" else {"algo.data_chunk_length": 5}),
        },
    )
    trainer = Trainer(cfg)
    rollout = trainer.collector.collect()
    assert rollout.groups["movers"].actions.dtype == torch.float32
    assert rollout.groups["pointer"].actions.dtype == torch.int64
    policy = trainer.policy
    samples = make_samples(policy, rollout, cfg.algo, recurrent != "none")
    valid = samples.valid.bool()
    for name, s in samples.groups.items():
        dist, _ = policy.actors[name](
            s.obs, s.actor_state, samples.starts, s.action_mask, s.actor_inject
        )
        torch.testing.assert_close(
            dist.log_prob(s.actions)[valid], s.log_probs[valid], atol=1e-5, rtol=1e-5
        )
    # One update runs and changes the Gaussian's parameters.
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.learner.iterate(trainer.iteration, trainer.env_steps)
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert any("actors.movers" in k for k in changed)
    if not state_std:
        log_std = policy.actors["movers"].log_std
        assert log_std.shape == (1 if share else 2, 1)


def test_the_log_std_starts_at_its_configured_value() -> None:
    for state_std in (False, True):
        cfg = C.load(
            None,
            {**REACH, "model.log_std_init": -1.5, "model.state_dependent_std": state_std},
        )
        env = ReachEnv(5)
        policy = ActorCritic(env.spec, cfg.model, cfg.algo)
        step = env.reset(seed=0)
        states = policy.initial_states(5, torch.device("cpu"))[0]
        dist, _ = policy.actors["movers"](
            step.obs["movers"].unsqueeze(0), states["movers"], torch.ones(1, 5).bool(), None
        )
        torch.testing.assert_close(dist.log_std, torch.full_like(dist.mean, -1.5))


def test_tanh_needs_finite_bounds() -> None:
    cfg = C.load(None, {**REACH, "model.action_bounds": "tanh"})
    env = ReachEnv(2, high=float("inf"))
    with pytest.raises(ValueError, match="model.action_bounds=clip"):
        ActorCritic(env.spec, cfg.model, cfg.algo)


# -- learning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bounds", ["clip", "tanh"])
def test_a_continuous_team_learns_to_reach_its_goals(tmp_path: Path, bounds: str) -> None:
    """Standing still returns about -5.3 (8 steps at a mean distance of 2/3); the best policy
    about -0.4. 30 updates of 512 steps reach better than -3 with either way of bounding."""
    untrained = Trainer(C.load(None, {**REACH, "model.action_bounds": bounds}))
    env = ReachEnv(256)
    before = evaluate(untrained.policy, env, seed=5)["eval_return_mean"]
    assert before < -4.5
    run = train(
        C.load(
            None,
            {
                **REACH,
                "model.action_bounds": bounds,
                "total_env_steps": 32 * 16 * 30,
                "eval_interval": 30,
                "run_dir": str(tmp_path),
            },
        )
    )
    after = evaluate(run.policy, env, seed=5)["eval_return_mean"]
    assert after > -3.0, (before, after)
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["eval_return_mean"] > -3.0


def test_a_mixed_team_trains_resumes_exactly_and_evaluates(tmp_path: Path) -> None:
    """One continuous and one discrete group in one env: training, evaluation, checkpoint and
    bit-exact resume, and the inference API's env actions inside the box."""
    cfg = {
        **REACH,
        "env.kwargs": {"mixed": True},
        "env.num_envs": 8,
        "total_env_steps": 8 * 16 * 6,
        "checkpoint_interval": 2,
        "eval_interval": 3,
        "eval_episodes": 8,
        "model.recurrent": "gru",
        "model.action_bounds": "tanh",
    }
    full = train(C.load(None, {**cfg, "run_dir": str(tmp_path / "a")}))
    part = train(C.load(None, {**cfg, "run_dir": str(tmp_path / "b")}))
    for p in sorted((part.dir / "checkpoints").glob("iter_*.pt")):
        if p.name > "iter_00000004.pt":
            p.unlink()
    resumed = resume(part.dir)
    a, b = full.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed.summary["eval_return_mean"] == full.summary["eval_return_mean"]

    from mappo.api import load_policy

    policy = load_policy(full.dir)
    env = ReachEnv(4, mixed=True)
    step = env.reset(seed=3)
    for _ in range(5):
        actions = policy.act(step.obs)
        assert actions["movers"].dtype == torch.float32 and actions["movers"].shape == (4, 2, 1)
        assert bool((actions["movers"].abs() <= 1.0).all())
        assert actions["pointer"].dtype == torch.int64
        step = env.step(actions)


def test_value_methods_refuse_continuous_groups() -> None:
    for algo in ("qmix", "vdn", "iql", "coma"):
        with pytest.raises(ConfigError, match="algo.name=mappo"):
            Trainer(C.load(None, {**REACH, "algo.name": algo}))


def test_the_pettingzoo_view_offers_box_actions() -> None:
    from gymnasium import spaces
    from pettingzoo.test import parallel_api_test

    from mappo.envs.pettingzoo_view import PettingZooView

    view = PettingZooView(ReachEnv(1, mixed=True))
    parallel_api_test(view, num_cycles=20)
    box = view.action_space("mover_1")
    assert isinstance(box, spaces.Box) and box.shape == (1,)
    assert np.all(box.low == -1.0) and np.all(box.high == 1.0)
    view.reset(seed=0)
    obs, *_ = view.step({"mover_0": np.array([1.0]), "mover_1": np.array([-1.0]), "pointer_0": 1})
    assert obs["mover_0"].shape == (2,)


def test_the_python_example_in_the_docs_runs() -> None:
    text = (Path(__file__).parents[1] / "docs" / "continuous.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks
    for block in blocks:
        exec(compile(block, "continuous.md", "exec"), {})


def test_the_continuous_spread_preset_trains(tmp_path: Path) -> None:
    run = train(
        "mpe/simple_spread_continuous",
        {
            "env.num_envs": 8,
            "total_env_steps": 8 * 25 * 2,
            "eval_episodes": 4,
            "progress": False,
            "run_dir": str(tmp_path),
        },
    )
    assert run.policy.actors["agents"].continuous
    assert math.isfinite(run.summary["eval_return_mean"])


def test_box_bounds_from_arrays_and_the_edges_of_tanh() -> None:
    from mappo.data import GroupSpec

    bounds = np.array([[-1.0, 0.0], [0.5, 2.0]])
    assert ActionSpec.box(bounds, 3.0) == ActionSpec(low=(-1.0, 0.0, 0.5, 2.0), high=(3.0,) * 4)
    assert ActionSpec.box(torch.tensor(0.0), torch.ones(2)).low == (0.0, 0.0)
    with pytest.raises(ValueError, match="no action mask"):
        GroupSpec(("a",), (2,), ActionSpec.box(0.0, [1.0]), has_action_mask=True)
    # A zero-width component cannot be squashed into; the float maximum as a bound can.
    assert not ActionSpec.box([0.0, 1.0], [0.0, 2.0]).bounded
    big = np.finfo(np.float32).max
    huge = DiagGaussian(
        torch.zeros(3, 1), torch.zeros(1), torch.tensor([-big]), torch.tensor([big]), "tanh"
    )
    u = torch.tensor([[-3.0], [0.0], [3.0]])
    assert torch.isfinite(huge.to_env(u)).all() and torch.isfinite(huge.log_prob(u)).all()
    # Not only finite but where the squash puts them: -big tanh(3), 0 and big tanh(3).
    torch.testing.assert_close(huge.to_env(u), torch.tanh(u) * big)
    cfg = C.load(None, {**REACH, "model.action_bounds": "tanh"})
    with pytest.raises(ConfigError, match="high > low"):
        ActorCritic(ReachEnv(2, low=0.0, high=0.0).spec, cfg.model, cfg.algo)
    cfg = C.load(None, {**REACH, "model.log_std_init": 5.0})
    with pytest.raises(ConfigError, match="log_std_init"):
        ActorCritic(ReachEnv(2).spec, cfg.model, cfg.algo)


def test_a_float64_box_gets_actions_inside_its_own_bounds() -> None:
    from gymnasium import spaces

    from mappo.envs.adapters._worker import _Slot, describe_agent

    box = spaces.Box(np.array([0.1, -0.3]), np.array([0.7, 0.1]), dtype=np.float64)
    desc = describe_agent("agent_0", spaces.Box(-1, 1, (3,)), box)
    slot = _Slot("agents", 0, desc, None)
    # The policy's float32 bounds, rounded outward, cast back to float64.
    row = [float(np.float32(0.7)), float(np.float32(-0.3))]
    action = slot.env_action(row)
    assert action.dtype == np.float64 and box.contains(action)
    with pytest.raises(ValueError, match="floating Box"):
        describe_agent("agent_0", spaces.Box(-1, 1, (3,)), spaces.Box(0, 5, (2,), dtype=np.int64))


def test_continuous_options_on_a_discrete_env_warn(tmp_path) -> None:
    """The Gaussian policy's options change nothing for an env without continuous actions
    (a continuous preset's settings over a discrete env): a new run says so."""
    over = ["model.log_std_init=-3", "env.num_envs=2", "total_env_steps=1", "eval_episodes=1"]
    with pytest.warns(UserWarning, match="model.log_std_init=-3.0: options of continuous"):
        train("mpe/simple_spread_fast", [*over, "threads=1", "progress=false"], run_dir=tmp_path)
