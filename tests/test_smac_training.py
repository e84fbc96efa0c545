"""The trainer on the combat simulator: masks, deaths and the agent-specific state end to end."""

from __future__ import annotations

import pytest
import torch

from mappo import config as C
from mappo.trainer import Trainer, evaluate, train


def test_short_3m_run_learns_to_win(tmp_path):
    cfg = C.load(
        "smac/3m_fast",
        {
            "env.num_envs": 64,
            "total_env_steps": 64 * 60 * 55,
            "eval_episodes": 32,
            "eval_interval": 0,
            "progress": False,
            "tensorboard": False,
            "run_dir": str(tmp_path),
            "seed": 3,
        },
    )
    before = Trainer(cfg)
    start = evaluate(before.policy, before.eval_env, seed=7)
    before.close()
    run = train(cfg)
    # A fresh policy almost never wins 3m; after ~210k steps it wins a good share of battles.
    assert start["eval_battle_won"] <= 0.1
    assert run.summary["eval_battle_won"] >= start["eval_battle_won"] + 0.3
    assert run.summary["eval_return_mean"] > start["eval_return_mean"] + 5


def test_dead_agents_only_no_op_and_leave_the_loss(tmp_path):
    cfg = C.load(
        "smac/3m",
        {
            "env.num_envs": 16,
            "rollout_length": 60,
            "progress": False,
            "total_env_steps": 960,
            "algo.epochs": 1,
        },
    )
    trainer = Trainer(cfg)
    ro = trainer.collector.collect()
    buf = ro.groups["allies"]
    dead = ~buf.alive
    assert dead.any(), "some allies should die within 60 steps of random play"
    # A dead agent's only allowed action is no-op (0), and that is what it took.
    assert torch.all(buf.actions[..., 0][dead] == 0)
    assert torch.all(buf.action_mask[dead][:, 0])
    assert not buf.action_mask[dead][:, 1:].any()
    # Death-masked critic input: zeros plus the agent's one-hot identity.
    x = buf.critic_x[dead]
    n = 3
    assert torch.all(x[:, :-n] == 0) and torch.all(x[:, -n:].sum(-1) == 1)
    trainer.close()


def test_state_critic_trains_without_the_agent_specific_state(tmp_path):
    overrides = {
        "env.num_envs": 8,
        "env.kwargs": {"agent_state": False},
        "rollout_length": 30,
        "progress": False,
        "total_env_steps": 480,
        "algo.epochs": 1,
        "run_dir": str(tmp_path),
    }
    with pytest.raises(ValueError, match="no agent-specific state; set algo.critic_input=state"):
        Trainer(C.load("smac/3m", overrides))
    for source in ("state", "concat_obs"):  # (the paper's "EP" and "CL")
        trainer = Trainer(C.load("smac/3m", {**overrides, "algo.critic_input": source}))
        metrics = trainer.iterate()
        assert trainer.env_steps == 240 and all(v == v for v in metrics.values())  # no NaN
        trainer.close()


@pytest.mark.parametrize("stacked_frames", [1, 3])
def test_a_resumed_battle_run_equals_one_never_stopped(tmp_path, stacked_frames):
    """Battles that end after the resume restart from the spare battles drawn before it (the
    env's state holds them, and the stacked frames kept): a run resumed at a checkpoint learns
    what the run never stopped learns, bit for bit (the resumed run's battles started from
    other positions)."""
    from mappo.trainer import load_checkpoint, resume

    over = {
        "env.kwargs.stacked_frames": stacked_frames,
        "env.num_envs": 8,
        "rollout_length": 30,
        "total_env_steps": 8 * 30 * 4,
        "checkpoint_interval": 2,
        "algo.epochs": 1,
        "eval_interval": 4,
        "eval_episodes": 2,
        "log_interval": 1,
        "progress": False,
        "threads": 1,
        "seed": 3,
    }
    full = train("smac/3m_fast", {**over, "run_dir": str(tmp_path / "a")})
    part = train("smac/3m_fast", {**over, "run_dir": str(tmp_path / "b")})
    later = part.dir / "checkpoints" / "iter_00000004.pt"
    env_state = load_checkpoint(later)["learner"]["collector"]["env"]["state"]
    assert "spare_health" in env_state and "spare_age" in env_state
    assert ("obs_history" in env_state) == (stacked_frames > 1)
    later.unlink()  # stopped after its checkpoint of iteration 2
    resumed = resume(part.dir)
    a, b = full.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    import csv

    rows_a = list(csv.DictReader((full.dir / "metrics.csv").open(encoding="utf-8")))
    rows_b = list(csv.DictReader((resumed.dir / "metrics.csv").open(encoding="utf-8")))
    for column in ("train/episode_return", "train/battle_won", "train/episode_length"):
        assert [r.get(column) for r in rows_a] == [r.get(column) for r in rows_b], column


def test_the_spare_battles_go_with_the_env_state():
    """get_state/set_state carry the battles that auto-resets restart from: an env set to
    another's state (and generator state) ends and restarts its battles as that env does."""
    from mappo.envs.registry import make

    a = make("smac/3m", num_envs=4, seed=1)
    b = make("smac/3m", num_envs=4, seed=2)
    mask = a.reset(seed=1).action_mask["allies"]
    b.reset(seed=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # (mid-way through a redraw period)
        mask = a.step({"allies": _random_actions(mask, gen)}).action_mask["allies"]
    b.set_state(a.get_state())
    b.generator.set_state(a.generator.get_state())
    ends = 0
    for _ in range(130):  # past the 60-step limit: every battle ends and restarts
        acts = _random_actions(mask, gen)
        sa, sb = a.step({"allies": acts}), b.step({"allies": acts})
        assert torch.equal(sa.obs["allies"], sb.obs["allies"])
        assert torch.equal(sa.state, sb.state)
        mask = sa.action_mask["allies"]
        ends += int((sa.terminated | sa.truncated).sum())
    assert ends >= 8


def _random_actions(mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One allowed action per ally ``[E, n, 1]``, uniform over ``mask [E, n, A]``."""
    picks = torch.multinomial(mask.flatten(0, 1).float(), 1, generator=gen)
    return picks.view(*mask.shape[:2], 1)
