"""Advantages and returns of a rollout, as pure functions of time-major tensors.

Every tensor is ``[T, *B]``: ``T`` steps of a rollout, ``B`` any batch dims (e.g. envs x agents).
Step ``t`` goes from state ``s_t`` (value ``values[t] = V(s_t)``) to the state after it, whose
value the caller passes as ``next_values[t]``:

- the episode continues: ``V(s_{t+1})``, i.e. ``values[t + 1]`` (the critic's value of the state
  after the last step for ``t = T - 1``);
- the episode was truncated at step ``t`` (time limit): ``V(final observation)`` to bootstrap the
  time limit, or 0 not to (the MAPPO paper's code treats a time limit as the end of the episode);
- the episode terminated at step ``t``: anything (it is ignored, a terminal state is worth 0).

:func:`next_values` builds this tensor from a ``[T + 1]`` value buffer. ``terminated`` and
``truncated`` (bool, or float 0/1) say that the episode ended *after* step ``t``; neither the
advantage nor the return recursion crosses that boundary. Values are de-normalised (in reward
units); de-normalising is the caller's job (``ValueNorm.denormalize``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class AdvantageReturns(NamedTuple):
    """The result of :func:`gae` and :func:`td_lambda`; unpacks as ``adv, ret = ...``."""

    advantages: Tensor
    """``[T, *B]`` advantage estimates ``returns - values``."""
    returns: Tensor
    """``[T, *B]`` value targets (lambda-returns)."""


def next_values(values: Tensor, truncated: Tensor, final_values: Tensor | None = None) -> Tensor:
    """``next_values`` for :func:`gae` / :func:`td_lambda` from a rollout's value buffer.

    Args:
        values: ``[T + 1, *B]`` critic values of the states the rollout acted on, plus the state
            after its last step (the post-reset state where an episode ended).
        truncated: ``[T, *B]`` (or broadcastable) bool, the episode hit its time limit at ``t``.
        final_values: ``[T, *B]`` values of the observations truncated episodes ended on (only
            read where ``truncated``), or ``None`` not to bootstrap time limits (then 0 there).

    Returns:
        ``[T, *B]``: ``values[t + 1]``, replaced where ``truncated[t]``. Where an episode
        terminated the value is left as is; :func:`gae` ignores it.
    """
    if final_values is None:
        return torch.where(truncated.bool(), 0.0, values[1:])
    return torch.where(truncated.bool(), final_values, values[1:])


def _broadcasts_to(small: torch.Size, big: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(small, big) == big
    except RuntimeError:
        return False


def _check(
    rewards: Tensor,
    values: Tensor,
    next_vals: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Validate shapes and coefficients; return ``(not_terminated, not_done)`` as floats."""
    shape = rewards.shape
    if rewards.dim() < 1 or shape[0] < 1:
        raise ValueError(f"rewards must be [T, *B] with T >= 1, got shape {tuple(shape)}")
    for name, x in (("values", values), ("next_values", next_vals)):
        if x.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected the rewards' shape {tuple(shape)}"
            )
    for name, x in (("terminated", terminated), ("truncated", truncated)):
        if x.dim() != len(shape) or not _broadcasts_to(x.shape, shape):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} or a shape that "
                "broadcasts to it with the same number of dims (e.g. [T, E, 1] for per-env flags)"
            )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    if terminated.dtype == torch.bool and truncated.dtype == torch.bool:
        not_term = (~terminated).to(rewards.dtype)
        not_done = (~(terminated | truncated)).to(rewards.dtype)
    else:
        not_term = 1.0 - terminated.to(rewards.dtype)
        not_done = not_term * (1.0 - truncated.to(rewards.dtype))
    return not_term, not_done


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> AdvantageReturns:
    """Generalised advantage estimation (Schulman et al. 2016, Eq. 16), time-major.

    ``delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t`` and
    ``A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}`` with ``A_T = 0`` and
    ``done = terminated | truncated``; ``returns = advantages + values``.

    Args:
        rewards, values, next_values: ``[T, *B]`` float (see the module docstring).
        terminated, truncated: ``[T, *B]`` bool or 0/1 float, or a shape broadcastable to it
            with the same number of dims (``[T, E, 1]`` against ``[T, E, n]``).
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1]: 0 is the one-step TD error, 1 the Monte-Carlo return
            bootstrapped with ``next_values`` at the rollout end and at truncations.

    Returns:
        ``AdvantageReturns(advantages [T, *B], returns [T, *B])``.
    """
    not_term, not_done = _check(rewards, values, next_values, terminated, truncated, gamma, lam)
    # delta_t = r_t - V(s_t) + gamma * V(s_{t+1}) (0 past a termination), then in place:
    # A_t = delta_t + gamma * lam * A_{t+1}, one fused multiply-add per step into views made once
    # (unbind), so the sequential Python loop costs a few microseconds per step.
    adv = torch.addcmul(rewards - values, next_values, not_term, value=gamma)
    discounts = (gamma * lam) * not_done
    a, c = adv.unbind(0), discounts.unbind(0)
    for t in range(len(a) - 2, -1, -1):
        torch.addcmul(a[t], c[t], a[t + 1], out=a[t])
    return AdvantageReturns(adv, adv + values)


def td_lambda(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> AdvantageReturns:
    """Lambda-returns by their recursive definition (Sutton & Barto 2018, Eq. 12.18), time-major.

    ``G_t = r_t + gamma * ((1 - lam) * V_{t+1} + lam * G_{t+1})`` with ``V_{t+1} =
    (1 - terminated_t) * next_values_t``; where the episode ended at ``t`` or ``t = T - 1``, the
    unknown ``G_{t+1}`` is replaced by ``V_{t+1}``, so ``G_t = r_t + gamma * V_{t+1}``. At
    ``lam = 1`` this is the discounted Monte-Carlo return bootstrapped at the rollout end (the
    MAPPO paper code's ``use_gae=False``). Equal to :func:`gae`'s returns up to rounding when
    the rollout is consistent, ``next_values[t] == values[t + 1]`` wherever the episode goes on
    (GAE reads ``V_{t+1}`` from ``values[t + 1]`` inside ``A_{t+1}``, this recursion from
    ``next_values[t]``).

    Arguments as :func:`gae`. Returns ``AdvantageReturns(returns - values, returns)``.
    """
    not_term, not_done = _check(rewards, values, next_values, terminated, truncated, gamma, lam)
    boot = next_values * not_term  # V_{t+1}, 0 past a termination
    # G_t = [r_t + gamma * (1 - lam) * V_{t+1}] + gamma * lam * G_{t+1}, with G_{t+1} := V_{t+1}
    # where the episode ended at t and at the rollout end.
    ret = torch.add(rewards, boot, alpha=gamma * (1.0 - lam))
    g, v_next, ended = ret.unbind(0), boot.unbind(0), (not_done == 0).unbind(0)
    torch.add(g[-1], v_next[-1], alpha=gamma * lam, out=g[-1])
    for t in range(len(g) - 2, -1, -1):
        following = torch.where(ended[t], v_next[t], g[t + 1])
        torch.add(g[t], following, alpha=gamma * lam, out=g[t])
    return AdvantageReturns(ret - values, ret)


# -- Q-learning targets over whole episodes -----------------------------------------------------


def _shift(x: Tensor, i: int, fill: float | bool) -> Tensor:
    """``x[t + i]`` along the first axis, ``fill`` past the end."""
    if i == 0:
        return x
    pad = torch.full_like(x[:i], fill)
    return torch.cat([x[i:], pad])


def n_step_targets(
    rewards: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    ends: Tensor,
    gamma: float,
    n: int,
) -> Tensor:
    """n-step targets ``G_t = r_t + ... + g^(j-1) r_(t+j-1) + g^j V(s_(t+j))`` with ``j = n``, or
    fewer steps where the episode ends first: no bootstrap after a termination, a bootstrap from
    the final observation after a truncation. ``n = 1`` is the one-step target of DQN/QMIX.

    ``rewards``, ``next_values`` (``V(s_(t+1))``) are ``[T, B, ...]``; ``terminated``, ``ends``
    (the episode ends after step t, by termination or truncation) are ``[T, B]`` bool. Steps past
    the end of an episode (padding) get meaningless values that the loss masks out.
    """
    extra = (1,) * (rewards.dim() - terminated.dim())
    term = terminated.reshape(*terminated.shape, *extra)
    end = ends.reshape(*ends.shape, *extra)
    out = torch.zeros_like(rewards)
    running = torch.ones_like(end)
    discount = 1.0
    for i in range(n):
        r_i, v_i = _shift(rewards, i, 0.0), _shift(next_values, i, 0.0)
        term_i, end_i = _shift(term, i, True), _shift(end, i, True)
        stop = end_i | (i == n - 1)
        out = out + running * discount * r_i
        out = out + (running & stop & ~term_i) * (discount * gamma) * v_i
        running = running & ~stop
        discount *= gamma
    return out


def lambda_targets(
    rewards: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    ends: Tensor,
    gamma: float,
    lam: float,
) -> Tensor:
    """TD(lambda) targets, ``G_t = r_t + g [(1 - lam) V(s_(t+1)) + lam G_(t+1)]``, cut at the end
    of the episode (``G_t = r_t + g V(s_(t+1))`` at its last step, with ``V = 0`` after a
    termination), as pymarl2 trains QMIX (Hu et al. 2021, "Rethinking the Implementation Tricks
    and Monotonicity Constraint in Cooperative MARL"). ``lam = 0`` is the one-step target.
    Shapes as :func:`n_step_targets`.
    """
    extra = (1,) * (rewards.dim() - terminated.dim())
    cont = (~terminated).reshape(*terminated.shape, *extra).to(rewards.dtype)
    end = ends.reshape(*ends.shape, *extra)
    out = torch.empty_like(rewards)
    later = next_values[-1]
    for t in range(rewards.shape[0] - 1, -1, -1):
        blended = torch.where(end[t], next_values[t], (1.0 - lam) * next_values[t] + lam * later)
        out[t] = rewards[t] + gamma * cont[t] * blended
        later = out[t]
    return out
