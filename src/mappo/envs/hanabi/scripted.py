"""A rule-based Hanabi player, to put learned scores in context (``mappo eval --scripted
hanabi/full-2p``).

Each turn, in this order of preference (using only what the player may know: its own cards'
hints, the others' cards, the board):

1. play a card that the hints prove playable (every card it could still be fits a firework);
2. with an information token, hint a playable card in another player's hand (the nearest player
   first, the oldest such card): its rank if the rank is not yet revealed, else its color;
3. if discarding is allowed, discard the oldest card without any hint (else the oldest card);
4. otherwise any legal hint (tokens are full and no hint is useful), never a blind play.

It plays every game of a batch at once on the env's device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mappo.envs.hanabi.env import HanabiEnv
from mappo.envs.registry import make


def scripted_moves(env: HanabiEnv) -> Tensor:
    """``[E]`` the rule-based move of the player to act in every game."""
    g, r = env.games, env.rules
    s = g.state
    p, h, c, rk = r.players, r.hand, r.colors, r.ranks
    e = env.num_envs
    rows = torch.arange(e, device=env.device)
    me = s["player"]
    legal = g.legal_moves()
    cards = torch.arange(c * rk, device=env.device)
    fits = s["fireworks"][:, cards // rk] == (cards % rk)[None, :]  # [E, C*R] playable cards

    # 1. a card of my hand that every possibility left by the hints would fit
    held = g._slots[None, :] < s["hand_count"][rows, me][:, None]  # [E, H]
    possible = s["color_ok"][rows, me][:, :, :, None] & s["rank_ok"][rows, me][:, :, None, :]
    possible = possible.reshape(e, h, c * rk)
    sure = held & possible.any(-1) & ~(possible & ~fits[:, None, :]).any(-1)
    play_slot = _first(sure)
    choice = torch.where(play_slot >= 0, h + play_slot, -1)

    # 2. a hint that reveals a playable card its holder does not know about yet
    hint = torch.full((e,), -1, dtype=torch.int64, device=env.device)
    for o in range(p - 1, 0, -1):  # the nearest player last, so that it wins
        target = (me + o) % p
        their = s["hands"][rows, target]  # [E, H]
        there = g._slots[None, :] < s["hand_count"][rows, target][:, None]
        playable = there & fits.gather(1, their.clamp(min=0))
        rank_known = s["rank_hint"][rows, target] >= 0
        color_known = s["color_hint"][rows, target] >= 0
        useful = playable & ~(rank_known & color_known)
        slot = _first(useful)
        card = their.gather(1, slot.clamp(min=0)[:, None]).squeeze(1)
        by_rank = ~rank_known.gather(1, slot.clamp(min=0)[:, None]).squeeze(1)
        rank_move = 2 * h + (p - 1) * c + (o - 1) * rk + card % rk
        color_move = 2 * h + (o - 1) * c + card // rk
        move = torch.where(by_rank, rank_move, color_move)
        hint = torch.where((slot >= 0) & (s["info"] > 0), move, hint)
    choice = torch.where(choice < 0, hint, choice)

    # 3. discard the oldest card without hints
    unhinted = held & (s["color_hint"][rows, me] < 0) & (s["rank_hint"][rows, me] < 0)
    slot = _first(unhinted)
    discard = torch.where(slot >= 0, slot, 0)
    can_discard = legal[:, :h].any(1)
    choice = torch.where((choice < 0) & can_discard, discard, choice)

    # 4. any hint (tokens are full, so one is legal), rather than a blind play; else the first
    # legal move
    hints = legal[:, 2 * h :]
    any_hint = torch.where(hints.any(1), 2 * h + hints.long().argmax(1), legal.long().argmax(1))
    return torch.where(choice < 0, any_hint, choice)


def _first(flags: Tensor) -> Tensor:
    """``[E]`` the index of the first True of each row of ``flags [E, H]``, -1 where none."""
    idx = flags.long().argmax(1)
    return torch.where(flags.any(1), idx, -1)


def evaluate_scripted(
    name: str, episodes: int = 100, seed: int = 0, device: str | torch.device = "cpu"
) -> dict[str, float]:
    """Play ``episodes`` games of ``hanabi/<variant>`` (one per env) with the rule-based player.
    Returns the mean and standard deviation of the episode return (the shared reward summed: the
    score, or 0 where the last life is lost) and the means of the env's episode statistics
    (score, share of perfect games, lives lost, game length, moves by kind)."""
    if episodes < 1:
        raise ValueError(f"episodes must be a positive integer, got {episodes!r}")
    env = make(name, num_envs=episodes, device=device, seed=seed)
    assert isinstance(env, HanabiEnv)
    env.reset(seed)
    totals = {k: torch.zeros((), device=env.device) for k in env.spec.stat_names}
    counted = torch.zeros(episodes, dtype=torch.bool, device=env.device)
    returns = torch.zeros(episodes, device=env.device)
    while not bool(counted.all()):
        moves = scripted_moves(env)
        acts = moves[:, None, None].expand(episodes, env.rules.players, 1)
        env.validate_actions = False  # only the player to act's move is read
        step = env.step({"players": acts})
        returns += step.reward["players"][:, 0] * ~counted
        first = step.done & ~counted
        for k in totals:
            totals[k] += (step.stats[k] * first).sum()
        counted |= step.done
    return {
        "mean_return": float(returns.mean()),
        "std_return": float(returns.std(unbiased=False)),
        **{k: float(v) / episodes for k, v in totals.items()},
    }
