"""The COMA update, in one file (Foerster et al. 2018, "Counterfactual Multi-Agent Policy
Gradients", Eq. 4, and PyMARL's ``coma_learner``).

The critic ``Q_a(s, u)`` is trained step by step, backwards through the episodes, on TD(lambda)
targets of a target critic (termination does not bootstrap; a truncated episode bootstraps from
the expected Q of its final state under the policy). The actor follows the counterfactual
advantage ``A_a = Q_a(s, u) - sum_u' pi_a(u' | tau_a) Q_a(s, (u^-a, u'))``: agent a's action
against the policy-weighted average of its alternatives, the others' actions held fixed.

Shapes: ``T`` steps of the longest episode (``T + 1`` stored), ``B`` episodes, ``n`` agents,
``A`` actions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def counterfactual_baseline(q: Tensor, probs: Tensor) -> Tensor:
    """``sum_u pi(u) Q(s, (u^-a, u))``: ``q``, ``probs`` ``[..., A]`` -> ``[...]``."""
    return (q * probs).sum(-1)


def coma_advantage(q: Tensor, probs: Tensor, actions: Tensor) -> Tensor:
    """``Q(s, u) - baseline`` for the actions taken ``[...]`` (int64)."""
    taken = q.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    return taken - counterfactual_baseline(q, probs)


def actor_loss(
    probs: Tensor, actions: Tensor, advantages: Tensor, weight: Tensor, entropy_coef: float
) -> tuple[Tensor, Tensor]:
    """Policy-gradient loss ``-mean(A * log pi(u))`` minus the entropy bonus, over the entries
    where ``weight`` (0/1, ``[...]``) is 1; returns the loss and the mean entropy."""
    count = weight.sum().clamp_min(1.0)
    keep = weight.bool()
    log_taken = probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1).clamp_min(1e-10).log()
    entropy = -(probs * probs.clamp_min(1e-10).log()).sum(-1)
    # where, not a product: whatever a padded step holds must not reach the gradient.
    pg = -torch.where(keep, advantages.detach() * log_taken, 0.0).sum() / count
    ent = torch.where(keep, entropy, 0.0).sum() / count
    return pg - entropy_coef * ent, ent


def final_step_mask(ends: Tensor) -> Tensor:
    """``[T + 1, B]`` bool: index t holds the final observation of an episode (it ended after
    step t - 1). ``ends`` is ``[T + 1, B]``."""
    return torch.cat([torch.zeros_like(ends[:1]), ends[:-1]])
