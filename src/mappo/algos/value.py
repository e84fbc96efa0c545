"""The value-decomposition update, in one file: exploration schedule, Q targets, the TD loss.

IQL, VDN and QMIX share this update and differ only in the mixer (:mod:`mappo.nn.q_agents`):
the agents' Q-values of the actions taken are mixed into the team's (per agent for IQL), the
target network gives the value of the next step (double Q: the online network picks the
action, the target network values it), the targets are one-step, n-step or TD(lambda) returns
over the stored episode, and the loss is the mean squared TD error over the steps the episodes
filled (Rashid et al. 2018, "QMIX", Section 4; PyMARL's ``QLearner``; pymarl2's TD(lambda)).
Termination never bootstraps; a time-limit truncation bootstraps from the final observation
(``bootstrap_truncation``) or ends the return, as PyMARL on SMAC and EPyMARL on the particle
world and LBF do, and every preset sets (on Spread the bootstrap makes QMIX's mixed Q ramp up
along the 25 steps and diverge).

Shapes: ``T`` steps of the longest sampled episode (``T + 1`` stored with the final
observation), ``B`` episodes, ``n`` agents of a group, ``N`` agents of all groups, ``A``
actions, ``C`` mixed values (1, or ``N`` for IQL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mappo.algos.mappo import grad_norm
from mappo.algos.returns import lambda_targets, n_step_targets
from mappo.config import ComaConfig, ValueConfig
from mappo.data import EpisodeBatch
from mappo.nn.normalizers import RunningMeanStd
from mappo.nn.q_agents import QNetworks, masked_argmax

# -- exploration -------------------------------------------------------------------------------


def epsilon_at(env_steps: int, cfg: ValueConfig | ComaConfig) -> float:
    """Epsilon after ``env_steps``: from ``epsilon_start`` to ``epsilon_finish`` over
    ``epsilon_anneal_steps``, linearly or exponentially (``start * (finish / start) ** frac``,
    PyMARL's exponential schedule written so that it reaches ``finish`` at the end), then flat."""
    frac = min(1.0, env_steps / cfg.epsilon_anneal_steps)
    start, finish = cfg.epsilon_start, cfg.epsilon_finish
    # (a 0 at either end, which mappo.config.check refuses for the exponential schedule, would
    # take the log of 0: a config built in code without that check anneals linearly)
    if cfg.epsilon_schedule == "linear" or start == 0.0 or finish == 0.0:
        return start + frac * (finish - start)
    return start * math.exp(frac * math.log(finish / start))


# -- the loss ----------------------------------------------------------------------------------


@dataclass
class TDTerms:
    """The loss and its diagnostics (scalars)."""

    loss: Tensor
    td_error_abs: Tensor  # mean |Q_taken - target| over filled steps
    q_taken_mean: Tensor  # mean mixed Q of the actions taken
    target_mean: Tensor  # mean target


def _allowed(batch: EpisodeBatch, name: str) -> Tensor | None:
    return batch.action_mask.get(name)


def td_loss(
    online: QNetworks,
    target: QNetworks,
    batch: EpisodeBatch,
    cfg: ValueConfig,
    reward_norm: RunningMeanStd | None = None,
) -> TDTerms:
    """Mean squared TD error of ``online`` on a time-major episode batch ``[T + 1, B, ...]``.

    Steps that are not ``filled`` (padding after an episode's end) have no weight; ``reward_norm``
    (when given) standardises the rewards after folding in this batch's filled ones.
    """
    q = online.unroll(batch.obs, batch.actions)  # [T + 1, B, n, A] per group
    with torch.no_grad():
        q_target = target.unroll(batch.obs, batch.actions)
    taken, next_q = [], []
    for name in online.agents:
        taken.append(q[name][:-1].gather(-1, batch.actions[name][:-1]).squeeze(-1))
        mask = _allowed(batch, name)
        if cfg.double_q:
            best = masked_argmax(q[name].detach(), mask)
            value = q_target[name].gather(-1, best.unsqueeze(-1)).squeeze(-1)
        elif mask is None:
            value = q_target[name].max(-1).values
        else:
            value = q_target[name].masked_fill(~mask, -torch.inf).max(-1).values
        next_q.append(value[1:])
    q_taken = online.mix(torch.cat(taken, -1), batch.state[:-1])  # [T, B, C]
    with torch.no_grad():
        next_values = target.mix(torch.cat(next_q, -1), batch.state[1:])  # [T, B, C]
        filled = batch.filled[:-1]
        rewards = batch.reward[:-1]
        if reward_norm is not None:
            reward_norm.update(rewards[filled])
            rewards = reward_norm.standardise(rewards)
        rewards = rewards.unsqueeze(-1).expand_as(next_values)
        term, ends = batch.terminated[:-1], batch.ends[:-1]
        if not cfg.bootstrap_truncation:
            term = ends  # a time limit ends the return like a terminal state
        if cfg.targets == "td_lambda":
            targets = lambda_targets(rewards, next_values, term, ends, cfg.gamma, cfg.td_lambda)
        else:
            n = cfg.n_step if cfg.targets == "n_step" else 1
            targets = n_step_targets(rewards, next_values, term, ends, cfg.gamma, n)
    weight = filled.unsqueeze(-1).to(q_taken.dtype).expand_as(q_taken)
    count = weight.sum().clamp_min(1.0)
    # where, not a product: a padded step's target may be anything, even infinite.
    error = torch.where(weight.bool(), q_taken - targets, 0.0)
    loss = error.square().sum() / count
    with torch.no_grad():
        return TDTerms(
            loss=loss,
            td_error_abs=error.abs().sum() / count,
            q_taken_mean=(q_taken * weight).sum() / count,
            target_mean=(targets * weight).sum() / count,
        )


# -- the optimiser and the target network ------------------------------------------------------


def make_optimizer(
    params: list[Tensor], cfg: ValueConfig | ComaConfig, lr: float | None = None
) -> torch.optim.Optimizer:
    """RMSprop (PyMARL: alpha 0.99, eps 1e-5) or Adam (EPyMARL, pymarl2), at ``lr`` (default
    ``cfg.lr``)."""
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=cfg.optim_alpha, eps=cfg.optim_eps)
    return torch.optim.Adam(params, lr=lr, eps=cfg.optim_eps)


@torch.no_grad()
def soft_update(target: torch.nn.Module, online: torch.nn.Module, tau: float) -> None:
    """``target <- target + tau * (online - target)`` for every parameter."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.lerp_(o, tau)


def update(
    online: QNetworks,
    target: QNetworks,
    batch: EpisodeBatch,
    optimizer: torch.optim.Optimizer,
    cfg: ValueConfig,
    reward_norm: RunningMeanStd | None = None,
) -> dict[str, Tensor]:
    """One gradient step on ``batch``; a soft target update after it when ``target_tau`` is set.
    Returns the loss terms and the gradient norm (before clipping)."""
    terms = td_loss(online, target, batch, cfg, reward_norm)
    optimizer.zero_grad(set_to_none=True)
    terms.loss.backward()
    norm = grad_norm([p for p in online.parameters() if p.grad is not None], cfg.max_grad_norm)
    optimizer.step()
    if cfg.target_tau is not None:
        soft_update(target, online, cfg.target_tau)
    return {
        "loss": terms.loss.detach(),
        "td_error_abs": terms.td_error_abs,
        "q_taken_mean": terms.q_taken_mean,
        "target_mean": terms.target_mean,
        "grad_norm": norm,
    }
