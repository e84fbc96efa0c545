"""A scripted baseline for the SMAC maps, and its evaluation.

The baseline plays what SMAC's built-in AI plays, through the agents' own action space: every
live unit attacks the closest live enemy when that attack is available, else moves toward it
(the available move that points most nearly at it). A medivac heals the most injured ally it may
heal, else follows the closest live non-medivac ally. With ``focus=True`` a unit attacks, among
the enemies it can attack, the one with the least health + shield (focus fire, the first trick
SMAC's maps reward), and behaves as above when it can attack none.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mappo.envs.base import EnvStep
from mappo.envs.registry import make
from mappo.envs.smac.env import N_NO_ATTACK, SMACEnv

FOLLOW_DISTANCE = 3.0
"""A medivac with nobody to heal stays within this distance of the closest ally."""


def _move_toward(delta: Tensor, move_ok: Tensor, moves: Tensor) -> tuple[Tensor, Tensor]:
    """Best available move toward ``delta [E, n, 2]``: ``(action [E, n], exists [E, n])``."""
    score = (delta[..., None, :] * moves).sum(-1)  # [E, n, 4]
    score = torch.where(move_ok, score, torch.full_like(score, -torch.inf))
    best, k = score.max(-1)
    return k + 2, torch.isfinite(best)


def scripted_actions(env: SMACEnv, step: EnvStep, focus: bool = False) -> dict[str, Tensor]:
    """Actions ``{"allies": [E, n]}`` int64 of the scripted baseline for the state ``step``
    was observed in (the env's current state)."""
    state = env.get_state()
    pos, health = state["pos"], state["health"]
    shield = state["shield"]
    n = env.n_agents
    mask = step.action_mask["allies"]
    E = pos.shape[0]
    dev = pos.device
    alive = health > 0
    me = alive[:, :n]
    moves = torch.tensor([[0.0, 1.0], [0.0, -1.0], [1.0, 0.0], [-1.0, 0.0]], device=dev)
    move_ok = mask[..., 2:N_NO_ATTACK]
    attack_ok = mask[..., N_NO_ATTACK:]

    # Closest live enemy of each ally.
    to_enemy = pos[:, None, n:] - pos[:, :n, None]  # [E, n, m, 2]
    d = to_enemy.norm(dim=-1).masked_fill(~alive[:, None, n:], torch.inf)
    closest = d.argmin(-1)  # [E, n]
    can_hit = attack_ok.gather(2, closest[..., None])[..., 0]
    target = closest
    if focus:
        # Least health + shield among the available targets; distance only breaks ties.
        hp = (health + shield)[:, None, n:] * 1e3 + d
        hp = torch.where(attack_ok, hp, torch.inf)
        best, weakest = hp.min(-1)
        can_hit = torch.isfinite(best)
        target = weakest
    delta = to_enemy.gather(2, closest[..., None, None].expand(E, n, 1, 2))[:, :, 0]
    move, has_move = _move_toward(delta, move_ok, moves)
    act = torch.where(can_hit, target + N_NO_ATTACK, torch.where(has_move, move, 1))

    # Medivacs: heal the most injured ally in reach, else stay close to the closest ally.
    healer = torch.tensor([u.healer for u in env.units[:n]], device=dev)
    heal_ok = attack_ok[..., :n]
    frac = health[:, :n] / torch.tensor([u.health for u in env.units[:n]], device=dev)
    frac = torch.where(heal_ok, frac[:, None, :].expand(E, n, n), torch.inf)
    best_frac, heal_target = frac.min(-1)
    fighter = alive[:, :n] & ~healer
    to_ally = pos[:, None, :n] - pos[:, :n, None]
    d_ally = to_ally.norm(dim=-1).masked_fill(~fighter[:, None, :], torch.inf)
    d_near, near = d_ally.min(-1)
    delta_a = to_ally.gather(2, near[..., None, None].expand(E, n, 1, 2))[:, :, 0]
    follow, has_follow = _move_toward(delta_a, move_ok, moves)
    follow = torch.where(has_follow & (d_near > FOLLOW_DISTANCE), follow, 1)
    heal_act = torch.where(torch.isfinite(best_frac), heal_target + N_NO_ATTACK, follow)
    act = torch.where(healer, heal_act, act)
    return {"allies": torch.where(me, act, 0)}


def evaluate_scripted(
    map_name: str,
    episodes: int = 32,
    num_envs: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    focus: bool = False,
) -> dict[str, float]:
    """Play ``episodes`` episodes of the scripted baseline on ``smac/<map_name>``.

    Each of the ``num_envs`` envs (default: one per episode) contributes its first episodes, as
    evenly as possible, so short episodes are not over-counted. Returns the win rate, the mean
    episode return (of one agent; all agents share the team reward) and its standard deviation,
    the mean episode length and the mean of every episode statistic.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be a positive integer, got {episodes!r}")
    num_envs = min(num_envs or episodes, episodes)
    env = make(f"smac/{map_name}", num_envs=num_envs, device=device, seed=seed)
    assert isinstance(env, SMACEnv)
    dev = env.device
    quota = torch.full((num_envs,), episodes // num_envs, device=dev)
    quota[: episodes % num_envs] += 1
    finished = torch.zeros(num_envs, dtype=torch.int64, device=dev)
    ep_return = torch.zeros(num_envs, device=dev)
    ep_length = torch.zeros(num_envs, device=dev)
    names = (*env.spec.stat_names, "return", "return_sq", "length")
    totals = {k: torch.zeros((), device=dev) for k in names}
    step = env.reset(seed)
    while bool((finished < quota).any()):
        step = env.step(scripted_actions(env, step, focus=focus))
        ep_return += step.reward["allies"][:, 0]
        ep_length += 1
        count = step.done & (finished < quota)
        for k in env.spec.stat_names:
            totals[k] += (step.stats[k] * count).sum()
        totals["return"] += (ep_return * count).sum()
        totals["return_sq"] += (ep_return.square() * count).sum()
        totals["length"] += (ep_length * count).sum()
        finished += step.done.long()
        ep_return = torch.where(step.done, torch.zeros_like(ep_return), ep_return)
        ep_length = torch.where(step.done, torch.zeros_like(ep_length), ep_length)
    out = {k: float(v) / episodes for k, v in totals.items()}
    return {
        "episodes": float(episodes),
        "win_rate": out["battle_won"],
        "mean_return": out["return"],
        "std_return": math.sqrt(max(out["return_sq"] - out["return"] ** 2, 0.0)),
        "mean_length": out["length"],
        **{k: out[k] for k in env.spec.stat_names},
    }
