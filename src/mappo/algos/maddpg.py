"""The MADDPG update, in one file (Lowe et al. 2017, Eqs. 5-6; the MAPPO
paper's off-policy baseline code, ``MADDPG.shared_train_policy_on_batch``).

**Critic.** ``Q(s_t, u_t)`` of the stored joint action regresses on the one-step target
``r_t + gamma * Q'(s_(t+1), u')``, where ``u'`` is every agent's greedy action under its target
actor (the allowed action of the largest logit; in a box the deterministic action) and ``Q'``
the target critic. Termination never
bootstraps; a time-limit truncation bootstraps from the final observation or, with
``bootstrap_truncation`` off, ends the return (the off-policy code on the particle world).

**Actors.** Agent a's loss is ``-Q(s_t, (u^-a_t, g_a))``: the critic of the stored joint
action with a's own block replaced by a straight-through Gumbel-softmax sample ``g_a`` of its
actor (Jang et al. 2017): the forward value is the sampled one-hot action, the gradient that of
the relaxed softmax. In a box ``g_a`` is the actor's deterministic action (the deterministic
policy gradient of Lowe et al. 2017, Eq. 6). Every agent's replacement is one row of one
batched critic call; the mean runs over the steps the episodes filled where the agent was
alive.

With ``td_lambda`` above 0 the critic's targets are TD(lambda) returns over the stored episode
(the greedy target actions' values at every step), as FACMAC's code trains its critic with
discrete actions.

**FACMAC** (Peng et al. 2021, "FACMAC: Factored Multi-Agent Centralised Policy Gradients",
Section 4; github.com/oxwhirl/facmac) differs in the critic and in the actors' loss. The critic
``Q_tot(s, u) = mix(s, Q_1(o_1, u_1), ..., Q_N(o_N, u_N))`` regresses on the same targets. The
actors' loss is ``-Q_tot(s_t, g_1, ..., g_N)`` with *every* agent's action from its current
actor at once (the centralised policy gradient, its Eq. 7), not one agent's among the others'
stored actions; the mean runs over the filled steps.

``actor_reg`` adds the mean square of the box actions ``u`` (FACMAC's continuous code).

Shapes: ``T`` steps of the longest sampled episode (``T + 1`` stored with the final
observation), ``B`` episodes, ``n`` agents of a group, ``A`` its actions, ``W`` the joint
action's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mappo.algos.mappo import grad_norm
from mappo.algos.returns import lambda_targets, n_step_targets
from mappo.algos.value import soft_update
from mappo.config import MaddpgConfig
from mappo.data import EpisodeBatch
from mappo.nn.maddpg import MaddpgNetworks
from mappo.nn.normalizers import RunningMeanStd


def gumbel_softmax_sample(
    logits: Tensor, mask: Tensor | None, temperature: float, generator: torch.Generator | None
) -> Tensor:
    """A one-hot sample ``[..., A]`` of ``softmax(logits)`` over the allowed actions, whose
    gradient is that of ``softmax((logits + G) / temperature)`` (``G`` the Gumbel noise that
    drew it): the straight-through Gumbel-softmax estimator. A row whose mask allows nothing
    (a dead agent's, which the env contract permits, or a padded step's) is sampled as if it
    allowed everything: its sample is replaced or weighed zero by the caller, and a row of
    ``-inf`` would be NaN, which a mixer's backward spreads to every weight."""
    if mask is not None:
        mask = mask | ~mask.any(-1, keepdim=True)
        logits = logits.masked_fill(~mask, -torch.inf)
    # -log of an Exp(1) draw is a standard Gumbel draw
    noise = -torch.empty_like(logits).exponential_(1, generator=generator).log()
    soft = torch.softmax((logits + noise) / temperature, -1)
    hard = F.one_hot(soft.argmax(-1), soft.shape[-1]).to(soft.dtype)
    return hard + soft - soft.detach()


def _targets(
    next_q: Tensor, batch: EpisodeBatch, cfg: MaddpgConfig, reward_norm: RunningMeanStd | None
) -> Tensor:
    """The critic's targets ``[T, B]`` from the target networks' values ``next_q [T, B]`` of
    the steps after: one-step, or TD(lambda) where ``cfg.td_lambda`` is above 0;
    ``reward_norm`` (when given) standardises the rewards after folding in this batch's filled
    ones."""
    filled = batch.filled[:-1]
    rewards = batch.reward[:-1]
    if reward_norm is not None:
        reward_norm.update(rewards[filled])
        rewards = reward_norm.standardise(rewards)
    ends = batch.ends[:-1]
    term = batch.terminated[:-1] if cfg.bootstrap_truncation else ends
    if cfg.td_lambda > 0.0:
        return lambda_targets(rewards, next_q, term, ends, cfg.gamma, cfg.td_lambda)
    return n_step_targets(rewards, next_q, term, ends, cfg.gamma, 1)


def critic_loss(
    online: MaddpgNetworks,
    target: MaddpgNetworks,
    batch: EpisodeBatch,
    cfg: MaddpgConfig,
    reward_norm: RunningMeanStd | None = None,
) -> dict[str, Tensor]:
    """Mean squared TD error of ``online.critic`` (MADDPG's joint critic, or FACMAC's mixed
    utilities) over the filled steps of a time-major episode batch ``[T + 1, B, ...]``.
    Returns ``loss`` and detached diagnostics."""
    features = online.features(batch.actions)  # [T + 1, B, n, A] per group
    with torch.no_grad():
        outputs = target.unroll(batch.obs, batch.actions)
        greedy = target.greedy_features(outputs, batch.action_mask)
    if cfg.name == "facmac":
        taken = {name: x[:-1] for name, x in features.items()}
        obs = {name: x[:-1] for name, x in batch.obs.items()}
        q = online.critic(obs, taken, batch.state[:-1])  # [T, B]
        with torch.no_grad():
            next_q = target.critic(batch.obs, greedy, batch.state)[1:]  # [T, B]
    else:
        q = online.critic(batch.state[:-1], online.joint(features)[:-1])  # [T, B]
        with torch.no_grad():
            next_q = target.critic(batch.state[1:], target.joint(greedy)[1:])  # [T, B]
    with torch.no_grad():
        targets = _targets(next_q, batch, cfg, reward_norm)
    filled = batch.filled[:-1]
    weight = filled.to(q.dtype)
    count = weight.sum().clamp_min(1.0)
    # where, not a product: a padded step's target may be anything, even infinite.
    error = torch.where(filled, q - targets, 0.0)
    with torch.no_grad():
        terms = {
            "td_error_abs": error.abs().sum() / count,
            "q_taken_mean": (q * weight).sum() / count,
            "target_mean": (targets * weight).sum() / count,
        }
    return {"loss": error.square().sum() / count, **terms}


def _policy_actions(
    online: MaddpgNetworks,
    outputs: dict[str, Tensor],
    batch: EpisodeBatch,
    cfg: MaddpgConfig,
    generator: torch.Generator | None,
) -> dict[str, Tensor]:
    """Every group's actions ``[T, B, n, A]`` for the actor loss from its actors' outputs
    ``[T + 1, B, n, A]``: the deterministic ``tanh`` in a box (the deterministic policy
    gradient), else one Gumbel-softmax sample per head, joined."""
    actions = {}
    for name, out in outputs.items():
        if online.continuous(name):
            actions[name] = torch.tanh(out[:-1])
            continue
        mask = batch.action_mask.get(name)
        heads = online.heads(name, out[:-1], None if mask is None else mask[:-1])
        t = cfg.gumbel_temperature
        parts = [gumbel_softmax_sample(h, m, t, generator) for h, m in heads]
        actions[name] = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    return actions


def _box_penalty(online: MaddpgNetworks, actions: dict[str, Tensor], filled: Tensor) -> Tensor:
    """The mean square of the box groups' actions ``u`` over the filled steps (0 without a
    box group)."""
    total = torch.zeros((), device=filled.device)
    count = torch.zeros((), device=filled.device)
    for name, u in actions.items():
        if online.continuous(name):
            keep = filled.reshape(*filled.shape, 1, 1).expand_as(u)
            total = total + torch.where(keep, u.square(), 0.0).sum()
            count = count + keep.sum()
    return total / count.clamp_min(1.0)


def actor_loss(
    online: MaddpgNetworks,
    batch: EpisodeBatch,
    cfg: MaddpgConfig,
    generator: torch.Generator | None,
) -> Tensor:
    """``-Q`` of every agent's own action (a Gumbel-softmax sample; in a box its deterministic
    action) among the others' stored ones, averaged over the filled steps where the agent was
    alive."""
    outputs = online.unroll(batch.obs, batch.actions)  # [T + 1, B, n, A] per group
    stored = {name: x[:-1] for name, x in online.features(batch.actions).items()}
    state = batch.state[:-1]
    filled = batch.filled[:-1]
    total = torch.zeros((), device=state.device)
    count = torch.zeros((), device=state.device)
    own_actions = _policy_actions(online, outputs, batch, cfg, generator)  # [T, B, n, A]
    for name, sample in own_actions.items():
        n = sample.shape[-2]
        own = torch.eye(n, dtype=torch.bool, device=sample.device).unsqueeze(-1)  # [n, n, 1]
        # row i: agent i's block from its sample, every other agent's as stored: [T, B, n, n, A]
        replaced = torch.where(own, sample.unsqueeze(-3), stored[name].unsqueeze(-3))
        blocks = {
            other: x.unsqueeze(-3).expand(*x.shape[:2], n, *x.shape[2:])
            for other, x in stored.items()
        }
        blocks[name] = replaced
        joint = online.joint(blocks)  # [T, B, n, W]
        q = online.critic(state.unsqueeze(2), joint)  # [T, B, n]
        keep = filled.unsqueeze(-1) & batch.alive[name][:-1]
        total = total - torch.where(keep, q, 0.0).sum()
        count = count + keep.sum()
    loss = total / count.clamp_min(1.0)
    if cfg.actor_reg > 0.0:
        loss = loss + cfg.actor_reg * _box_penalty(online, own_actions, filled)
    return loss


def facmac_actor_loss(
    online: MaddpgNetworks,
    batch: EpisodeBatch,
    cfg: MaddpgConfig,
    generator: torch.Generator | None,
) -> Tensor:
    """``-Q_tot`` of every living agent's action from its current actor at once (a
    Gumbel-softmax sample; in a box the deterministic action; a dead agent's as stored),
    averaged over the filled steps."""
    outputs = online.unroll(batch.obs, batch.actions)  # [T + 1, B, n, A] per group
    actions = _policy_actions(online, outputs, batch, cfg, generator)  # [T, B, n, A]
    # a dead agent's action as stored: its actor is not trained where it acts on nothing (an
    # action mask may not force it to a no-op, and a box has none)
    stored = online.features(batch.actions)
    actions = {
        name: torch.where(batch.alive[name][:-1].unsqueeze(-1), u, stored[name][:-1])
        for name, u in actions.items()
    }
    obs = {name: x[:-1] for name, x in batch.obs.items()}
    q = online.critic(obs, actions, batch.state[:-1])  # [T, B]
    filled = batch.filled[:-1]
    loss = -torch.where(filled, q, 0.0).sum() / filled.sum().clamp_min(1)
    if cfg.actor_reg > 0.0:
        loss = loss + cfg.actor_reg * _box_penalty(online, actions, filled)
    return loss


def update(
    online: MaddpgNetworks,
    target: MaddpgNetworks,
    batch: EpisodeBatch,
    actor_optim: torch.optim.Optimizer,
    critic_optim: torch.optim.Optimizer,
    cfg: MaddpgConfig,
    generator: torch.Generator | None,
    reward_norm: RunningMeanStd | None = None,
) -> dict[str, Tensor]:
    """One critic step, then one actor step on the updated critic (MADDPG's or FACMAC's actor
    loss, by ``cfg.name``), then the targets' Polyak step. Returns the losses, the critic's
    diagnostics and both gradient norms (before clipping)."""
    critic = online.critic
    terms = critic_loss(online, target, batch, cfg, reward_norm)
    critic_optim.zero_grad(set_to_none=True)
    terms["loss"].backward()
    critic_norm = grad_norm(list(critic.parameters()), cfg.max_grad_norm)
    critic_optim.step()
    # The actor's gradient passes through the critic's input, not into its weights.
    critic.requires_grad_(False)
    try:
        losses = facmac_actor_loss if cfg.name == "facmac" else actor_loss
        loss = losses(online, batch, cfg, generator)
        actor_optim.zero_grad(set_to_none=True)
        loss.backward()
    finally:
        critic.requires_grad_(True)
    actor_params = [p for p in online.agents.parameters() if p.grad is not None]
    actor_norm = grad_norm(actor_params, cfg.max_grad_norm)
    actor_optim.step()
    soft_update(target, online, cfg.target_tau)
    return {
        "critic_loss": terms.pop("loss").detach(),
        "actor_loss": loss.detach(),
        **terms,
        "critic_grad_norm": critic_norm,
        "actor_grad_norm": actor_norm,
    }
