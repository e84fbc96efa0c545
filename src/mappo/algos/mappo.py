"""The MAPPO update, in one file: returns, flattening into chunks, the loss and the optimiser step.

The loss follows Yu et al. (2022), "The Surprising Effectiveness of PPO in Cooperative
Multi-Agent Games", and its code: a clipped surrogate with an entropy bonus for the actors; a
clipped, Huber (delta 10) value loss on normalised targets (ValueNorm or PopArt) for the critics;
active masks so that dead agents do not count; separate gradient-norm clipping of each network;
separate Adam optimisers for actors and critics. MAPPO, IPPO and their recurrent forms differ only
in the critic's input and the presence of the recurrent layer (see :mod:`mappo.nn.actor_critic`).

Shapes: ``T`` rollout steps, ``E`` envs, ``n`` agents of a group, ``C`` critic copies, ``L`` chunk
length (1 for feed-forward networks), ``M`` chunks (samples) of the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mappo.algos.returns import gae, next_values, td_lambda
from mappo.config import AlgoConfig
from mappo.nn.actor_critic import ActorCritic
from mappo.rollout import Rollout

# -- losses -----------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` (float 0/1, broadcastable) is 1."""
    if mask is None:
        return x.mean()
    mask = mask.expand_as(x)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def value_loss(values: Tensor, old_values: Tensor, targets: Tensor, cfg: AlgoConfig) -> Tensor:
    """Elementwise value loss on normalised values and targets (all ``[...]``).

    Huber with ``cfg.huber_delta`` or half squared error; with ``cfg.clip_value_loss`` the
    maximum of the losses of the raw and of the clipped prediction
    ``old + clamp(v - old, -eps, eps)`` (the paper's Eq. 3 value clipping).
    """

    def loss(err: Tensor) -> Tensor:
        if cfg.value_loss == "huber":
            return F.huber_loss(err, torch.zeros_like(err), reduction="none", delta=cfg.huber_delta)
        return 0.5 * err.square()

    raw = loss(targets - values)
    if not cfg.clip_value_loss:
        return raw
    eps = cfg.clip if cfg.value_clip is None else cfg.value_clip
    clipped = old_values + (values - old_values).clamp(-eps, eps)
    return torch.maximum(raw, loss(targets - clipped))


def policy_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """Elementwise clipped surrogate (to minimise) and the ratio ``pi / pi_old``."""
    ratio = torch.exp(log_probs - old_log_probs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip, 1.0 + clip) * advantages)
    return -surrogate, ratio


# -- returns and samples ----------------------------------------------------------------------


@dataclass
class GroupSamples:
    """One group's update data, chunked: agent tensors ``[L, M, n, ...]``, critic ``[L, M, C]``."""

    obs: Tensor
    actions: Tensor
    log_probs: Tensor
    advantages: Tensor  # [L, M, n]
    alive: Tensor  # [L, M, n] float, 0 for dead agents and for padding
    action_mask: Tensor | None
    critic_x: Tensor
    values: Tensor  # [L, M, C] normalised old values
    returns: Tensor  # [L, M, n] de-normalised value targets
    actor_state: Tensor  # [M, n, S] stored recurrent state at each chunk start
    critic_state: Tensor  # [M, C, S]


@dataclass
class Samples:
    groups: dict[str, GroupSamples]
    starts: Tensor  # [L, M]
    valid: Tensor  # [L, M] float: 0 on padding added to make T a multiple of L
    padded: bool


def compute_returns(
    policy: ActorCritic, ro: Rollout, cfg: AlgoConfig
) -> dict[str, tuple[Tensor, Tensor]]:
    """Per group ``(advantages [T, E, n], returns [T, E, n])`` from a filled rollout."""
    estimator = gae if cfg.returns == "gae" else td_lambda
    out = {}
    term = ro.terminated.unsqueeze(-1)
    trunc = ro.truncated.unsqueeze(-1)
    for name, buf in ro.groups.items():
        critic = policy.critics[name]
        n = buf.rewards.shape[-1]
        values = critic.denormalize(buf.values).expand(-1, -1, n)  # C = 1 broadcasts to n
        final = None
        if cfg.bootstrap_truncation and buf.final_values is not None:
            final = critic.denormalize(buf.final_values).expand(-1, -1, n)
        nxt = next_values(values, trunc, final)
        out[name] = estimator(
            buf.rewards, values[:-1].contiguous(), nxt, term, trunc, cfg.gamma, cfg.gae_lambda
        )
    return out


def _chunk(x: Tensor, length: int) -> Tensor:
    """``[T', E, ...] -> [L, (T'/L) * E, ...]``: consecutive ``L``-step pieces of each env."""
    T, E = x.shape[:2]
    x = x.reshape(T // length, length, E, *x.shape[2:]).transpose(0, 1)
    return x.reshape(length, (T // length) * E, *x.shape[3:])


def _pad_time(x: Tensor, padded_length: int) -> Tensor:
    if x.shape[0] == padded_length:
        return x
    pad = x.new_zeros(padded_length - x.shape[0], *x.shape[1:])
    return torch.cat([x, pad])


def make_samples(policy: ActorCritic, ro: Rollout, cfg: AlgoConfig, recurrent: bool) -> Samples:
    """Returns, advantage normalisation and chunking: the one place the rollout is flattened.

    Recurrent networks train on chunks of ``data_chunk_length`` steps that start from the stored
    recurrent state; the time axis is zero-padded to a multiple of the chunk length and the
    padding is masked out of every loss. Feed-forward networks use chunks of one step.
    """
    T, E = ro.starts.shape
    L = cfg.data_chunk_length if recurrent else 1
    Tp = -(-T // L) * L
    returns = compute_returns(policy, ro, cfg)

    if cfg.normalize_advantages:
        # Statistics over alive agents only (the paper's active-masked advantage normalisation).
        adv_all = torch.cat([a.flatten() for a, _ in returns.values()])
        alive_all = torch.cat([b.alive.flatten() for b in ro.groups.values()]).to(adv_all.dtype)
        count = alive_all.sum().clamp_min(1.0)
        mean = (adv_all * alive_all).sum() / count
        std = (((adv_all - mean) * alive_all).square().sum() / count).sqrt()

    def prep(x: Tensor) -> Tensor:
        return _chunk(_pad_time(x, Tp), L)

    groups = {}
    for name, buf in ro.groups.items():
        adv, ret = returns[name]
        if cfg.normalize_advantages:
            adv = (adv - mean) / (std + 1e-5)
        groups[name] = GroupSamples(
            obs=prep(buf.obs),
            actions=prep(buf.actions),
            log_probs=prep(buf.log_probs),
            advantages=prep(adv),
            alive=prep(buf.alive.to(adv.dtype)),
            action_mask=None if buf.action_mask is None else prep(buf.action_mask),
            critic_x=prep(buf.critic_x),
            values=prep(buf.values[:-1]),
            returns=prep(ret),
            actor_state=prep(buf.actor_state)[0],
            critic_state=prep(buf.critic_state)[0],
        )
    valid = prep(torch.ones(T, E, device=ro.starts.device))
    return Samples(groups, prep(ro.starts), valid, padded=Tp != T)


# -- the update -------------------------------------------------------------------------------


@dataclass
class Optimizers:
    actor: torch.optim.Adam
    critic: torch.optim.Adam

    @classmethod
    def create(cls, policy: ActorCritic, cfg: AlgoConfig) -> Optimizers:
        return cls(
            torch.optim.Adam(
                policy.actors.parameters(),
                lr=cfg.actor_lr,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            ),
            torch.optim.Adam(
                policy.critics.parameters(),
                lr=cfg.critic_lr,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            ),
        )

    def set_lr_fraction(self, fraction: float, cfg: AlgoConfig) -> None:
        """Linear learning-rate decay: ``lr = fraction * initial lr``."""
        for opt, lr in ((self.actor, cfg.actor_lr), (self.critic, cfg.critic_lr)):
            for group in opt.param_groups:
                group["lr"] = lr * fraction


def _grad_norm(params: list[Tensor], max_norm: float | None) -> Tensor:
    if max_norm is None:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def update(
    policy: ActorCritic,
    samples: Samples,
    optimizers: Optimizers,
    cfg: AlgoConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """``cfg.epochs`` passes of ``cfg.num_minibatches`` mini-batches over ``samples``.

    Returns the mean over mini-batches of the loss terms and diagnostics.
    """
    M = samples.starts.shape[1]
    sums: dict[str, Tensor] = {}
    batches = 0
    actor_params = {g: [p for p in a.parameters()] for g, a in policy.actors.items()}
    critic_params = {g: [p for p in c.parameters()] for g, c in policy.critics.items()}

    for _ in range(cfg.epochs):
        order = torch.randperm(M, generator=generator).to(samples.starts.device)
        for idx in order.chunk(cfg.num_minibatches):
            terms = _minibatch_loss(policy, samples, idx, cfg)
            optimizers.actor.zero_grad(set_to_none=True)
            optimizers.critic.zero_grad(set_to_none=True)
            (terms["actor_loss"] + terms["critic_loss"]).backward()
            for g in policy.actors:
                terms[f"{g}/actor_grad_norm"] = _grad_norm(actor_params[g], cfg.max_grad_norm)
                terms[f"{g}/critic_grad_norm"] = _grad_norm(critic_params[g], cfg.max_grad_norm)
            optimizers.actor.step()
            optimizers.critic.step()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
            batches += 1
    return {k: float(v) / batches for k, v in sums.items()}


def _minibatch_loss(
    policy: ActorCritic, samples: Samples, idx: Tensor, cfg: AlgoConfig
) -> dict[str, Tensor]:
    starts = samples.starts[:, idx]
    valid = samples.valid[:, idx]
    terms: dict[str, Tensor] = {}
    actor_loss = torch.zeros((), device=starts.device)
    critic_loss = torch.zeros((), device=starts.device)
    for name, s in samples.groups.items():
        alive = s.alive[:, idx]  # [L, m, n]; also 0 on padding
        mask = None if s.action_mask is None else s.action_mask[:, idx]
        dist, _ = policy.actors[name](s.obs[:, idx], s.actor_state[idx], starts, mask)
        log_probs = dist.log_prob(s.actions[:, idx])
        surrogate, ratio = policy_loss(
            log_probs, s.log_probs[:, idx], s.advantages[:, idx], cfg.clip
        )
        p_mask = alive if cfg.policy_active_masks else valid.unsqueeze(-1)
        pg = masked_mean(surrogate, p_mask)
        entropy = masked_mean(dist.entropy(), p_mask)

        critic = policy.critics[name]
        returns = s.returns[:, idx]  # [L, m, n]
        # ValueNorm/PopArt statistics are updated with every mini-batch's targets before they
        # are normalised, as in the paper's code; padding is left out of the statistics. PopArt
        # rescales the value head in place, so this comes before the critic's forward pass.
        critic.update_normalizer(returns[valid.bool()] if samples.padded else returns)
        targets = critic.normalize(returns)
        values, _ = critic(s.critic_x[:, idx], s.critic_state[idx], starts)  # [L, m, C]
        n = returns.shape[-1]
        v_loss_all = value_loss(
            values.expand(-1, -1, n), s.values[:, idx].expand(-1, -1, n), targets, cfg
        )
        v_mask = alive if cfg.value_active_masks else valid.unsqueeze(-1)
        v_loss = masked_mean(v_loss_all, v_mask)

        actor_loss = actor_loss + pg - cfg.entropy_coef * entropy
        critic_loss = critic_loss + cfg.value_coef * v_loss
        with torch.no_grad():
            log_ratio = log_probs - s.log_probs[:, idx]
            terms[f"{name}/policy_loss"] = pg
            terms[f"{name}/value_loss"] = v_loss
            terms[f"{name}/entropy"] = entropy
            terms[f"{name}/approx_kl"] = masked_mean((ratio - 1.0) - log_ratio, p_mask)
            terms[f"{name}/clip_fraction"] = masked_mean(
                ((ratio - 1.0).abs() > cfg.clip).to(ratio.dtype), p_mask
            )
    terms["actor_loss"] = actor_loss
    terms["critic_loss"] = critic_loss
    return terms
