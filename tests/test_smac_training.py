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
    trainer = Trainer(C.load("smac/3m", {**overrides, "algo.critic_input": "state"}))
    metrics = trainer.iterate()
    assert trainer.env_steps == 240 and all(v == v for v in metrics.values())  # no NaN
    trainer.close()
