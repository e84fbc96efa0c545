"""The scripted SMAC baseline: its actions are always valid, its evaluation is reproducible, and
the maps are balanced the way SMAC's are (mirror maps even, the hard maps lost)."""

from __future__ import annotations

import pytest
import torch

from mappo.envs import make
from mappo.envs.smac import SMACEnv, evaluate_scripted, scripted_actions
from mappo.envs.smac.env import N_NO_ATTACK


@pytest.mark.parametrize("name", ["3m", "MMM2", "corridor", "2m_vs_1z"])
@pytest.mark.parametrize("focus", [False, True])
def test_actions_are_valid_and_follow_the_rule(name: str, focus: bool) -> None:
    env = make(f"smac/{name}", num_envs=16, seed=4)
    assert isinstance(env, SMACEnv) and env.validate_actions
    n = env.n_agents
    healer = torch.tensor([u.healer for u in env.units[:n]])
    step = env.reset()
    attacked = 0
    for _ in range(40):
        actions = scripted_actions(env, step, focus=focus)["allies"]
        st = env.get_state()
        assert torch.equal(actions == 0, ~step.alive["allies"])
        if not focus:
            # A fighter that attacks targets its closest live enemy.
            d = torch.cdist(st["pos"][:, :n], st["pos"][:, n:])
            d = d.masked_fill(st["health"][:, None, n:] <= 0, torch.inf)
            fighting = (actions >= N_NO_ATTACK) & ~healer
            closest = d.argmin(-1) + N_NO_ATTACK
            assert torch.equal(actions[fighting], closest[fighting])
            attacked += int(fighting.sum())
        step = env.step({"allies": actions})  # validated against the masks
    assert focus or attacked > 0


def test_evaluation_is_reproducible() -> None:
    a = evaluate_scripted("3m", episodes=24, num_envs=8, seed=3)
    b = evaluate_scripted("3m", episodes=24, num_envs=8, seed=3)
    assert a == b
    assert set(a) == {
        "episodes",
        "win_rate",
        "mean_return",
        "std_return",
        "mean_length",
        "battle_won",
        "allies_killed",
        "enemies_killed",
        "damage_dealt",
    }
    assert a["episodes"] == 24 and 0.0 <= a["win_rate"] <= 1.0
    assert 0.0 < a["mean_return"] <= 20.0 + 1e-4 and 0.0 <= a["std_return"] <= 10.0 + 1e-4
    assert 0.0 <= a["enemies_killed"] <= 3.0 and 0.0 <= a["allies_killed"] <= 3.0
    assert a["mean_length"] <= 60
    with pytest.raises(ValueError, match="episodes"):
        evaluate_scripted("3m", episodes=0)


def test_maps_are_balanced_like_smacs() -> None:
    # The baseline plays what the built-in AI plays: mirror maps are close to even.
    for name in ("3m", "8m"):
        assert 0.3 <= evaluate_scripted(name, episodes=96)["win_rate"] <= 0.7, name
    # Outnumbered or needing micro (kiting, focus fire): the baseline loses.
    for name in ("5m_vs_6m", "3s_vs_3z", "2m_vs_1z", "MMM2", "6h_vs_8z"):
        assert evaluate_scripted(name, episodes=32)["win_rate"] <= 0.1, name
    # Focus fire and healing win the combined-arms mirror map.
    mmm = evaluate_scripted("MMM", episodes=48, focus=True)["win_rate"]
    assert mmm >= 0.7
