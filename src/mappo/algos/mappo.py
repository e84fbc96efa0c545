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

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mappo.algos.returns import gae, next_values, td_lambda
from mappo.config import AlgoConfig
from mappo.data import Rollout
from mappo.nn.actor_critic import ActorCritic

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
    actor_inject: Tensor | None  # [L, M, n, S] state to restore where a chunk enters a new env
    critic_inject: Tensor | None  # [L, M, C, S]


@dataclass
class Samples:
    groups: dict[str, GroupSamples]
    starts: Tensor  # [L, M] bool: the recurrent state is reset before this step
    valid: Tensor  # [L, M] float: 0 on the padding that makes E * T a multiple of L
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
    """``[T, E, ...] -> [L, M, ...]``: the rollout flattened env-major (each env's steps in
    order, one env after another) and cut into ``L``-step chunks; the tail is zero-padded to a
    multiple of ``L``. Chunks may cross from one env into the next: :func:`make_samples` marks
    those boundaries so that the recurrent state is replaced there, as at an episode start."""
    T, E = x.shape[:2]
    flat = x.transpose(0, 1).reshape(T * E, *x.shape[2:])
    pad = -(T * E) % length
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, *flat.shape[1:])])
    return flat.reshape(flat.shape[0] // length, length, *flat.shape[1:]).transpose(0, 1)


def make_samples(policy: ActorCritic, ro: Rollout, cfg: AlgoConfig, recurrent: bool) -> Samples:
    """Returns, advantage normalisation and chunking: the one place the rollout is flattened.

    Recurrent networks train on chunks of ``data_chunk_length`` steps that start from the stored
    recurrent state (the MAPPO paper's chunked recurrent training); where a chunk crosses into
    the next env, the state is reset there, to zeros at an episode start and to that env's stored
    state otherwise. Feed-forward networks use chunks of one step.
    """
    T, E = ro.starts.shape
    L = cfg.data_chunk_length if recurrent else 1
    dev = ro.starts.device
    returns = compute_returns(policy, ro, cfg)

    if cfg.normalize_advantages:
        # Statistics over alive agents only (the paper's active-masked advantage normalisation).
        adv_all = torch.cat([a.flatten() for a, _ in returns.values()])
        alive_all = torch.cat([b.alive.flatten() for b in ro.groups.values()]).to(adv_all.dtype)
        count = alive_all.sum().clamp_min(1.0)
        mean = (adv_all * alive_all).sum() / count
        std = (((adv_all - mean) * alive_all).square().sum() / count).sqrt()

    starts = _chunk(ro.starts, L)
    first_step = torch.zeros(T, E, dtype=torch.bool, device=dev)
    first_step[0] = True
    inject = _chunk(first_step, L) & ~starts
    inject[0] = False  # a chunk's first step already starts from the stored state
    # One host check per update: on aligned episodes (the particle world) nothing is injected.
    needs_inject = recurrent and bool(inject.any())

    def injected(stored: Tensor) -> Tensor | None:
        if not needs_inject:
            return None
        return stored * inject.reshape(*inject.shape, 1, 1).to(stored.dtype)

    groups = {}
    for name, buf in ro.groups.items():
        adv, ret = returns[name]
        if cfg.normalize_advantages:
            adv = (adv - mean) / (std + 1e-5)
        actor_state = _chunk(buf.actor_state, L)
        critic_state = _chunk(buf.critic_state, L)
        groups[name] = GroupSamples(
            obs=_chunk(buf.obs, L),
            actions=_chunk(buf.actions, L),
            log_probs=_chunk(buf.log_probs, L),
            advantages=_chunk(adv, L),
            alive=_chunk(buf.alive.to(adv.dtype), L),
            action_mask=None if buf.action_mask is None else _chunk(buf.action_mask, L),
            critic_x=_chunk(buf.critic_x, L),
            values=_chunk(buf.values[:-1], L),
            returns=_chunk(ret, L),
            actor_state=actor_state[0],
            critic_state=critic_state[0],
            actor_inject=injected(actor_state),
            critic_inject=injected(critic_state),
        )
    valid = _chunk(torch.ones(T, E, device=dev), L)
    return Samples(groups, starts | inject, valid, padded=(T * E) % L != 0)


# -- the update -------------------------------------------------------------------------------


def fused_adam(module: torch.nn.Module) -> bool | None:
    """``True`` where torch has a fused Adam for all of ``module``'s parameters (CPU and CUDA
    float tensors): one kernel per step instead of a dozen per parameter list, the same update
    (measured 78 against 222 us per step of the particle-world actor on the CPU, BENCHMARKS.md).
    ``None`` (torch's default choice) elsewhere."""
    params = list(module.parameters())
    ok = bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )
    return True if ok else None


@dataclass
class Optimizers:
    actor: torch.optim.Adam
    critic: torch.optim.Adam

    @classmethod
    def create(cls, policy: ActorCritic, cfg: AlgoConfig) -> Optimizers:
        fused = fused_adam(policy)
        return cls(
            torch.optim.Adam(
                policy.actors.parameters(),
                lr=cfg.actor_lr,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                fused=fused,
            ),
            torch.optim.Adam(
                policy.critics.parameters(),
                lr=cfg.critic_lr,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                fused=fused,
            ),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, saved in ((self.actor, state["actor"]), (self.critic, state["critic"])):
            # A checkpoint carries its optimiser's implementation flags; this process's are
            # kept (the same update either way: a saved unfused Adam resumes fused). They are
            # set before loading, because torch places the step counters by the loaded flags
            # (on the parameters' device for fused Adam).
            flags = [g.get("fused") for g in opt.param_groups]
            groups = [{**g, "fused": f} for g, f in zip(saved["param_groups"], flags, strict=True)]
            opt.load_state_dict({**saved, "param_groups": groups})

    def set_lr_fraction(self, fraction: float, cfg: AlgoConfig) -> None:
        """Linear learning-rate decay: ``lr = fraction * initial lr``."""
        for opt, lr in ((self.actor, cfg.actor_lr), (self.critic, cfg.critic_lr)):
            for group in opt.param_groups:
                group["lr"] = lr * fraction


def grad_norm(params: list[Tensor], max_norm: float | None) -> Tensor:
    """The gradients' global norm, after clipping them to ``max_norm`` when it is set."""
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
    terms_fn: Callable[..., dict[str, Tensor]] | None = None,
) -> dict[str, float]:
    """``cfg.epochs`` passes of ``cfg.num_minibatches`` mini-batches over ``samples``.

    ``terms_fn`` computes a mini-batch's loss terms (:func:`loss_terms` when ``None``; the
    compiled path passes its compiled form). Returns the mean over mini-batches of the loss terms
    and diagnostics.
    """
    M = samples.starts.shape[1]
    sums: dict[str, Tensor] = {}
    batches = 0
    actor_params = {g: [p for p in a.parameters()] for g, a in policy.actors.items()}
    critic_params = {g: [p for p in c.parameters()] for g, c in policy.critics.items()}

    for _ in range(cfg.epochs):
        if cfg.num_minibatches == 1:
            # One full batch: its gradient does not depend on the order, so skip the shuffle
            # and the copies that indexing would make.
            batches_of_epoch: list[Tensor | None] = [None]
        else:
            order = torch.randperm(M, generator=generator).to(samples.starts.device)
            batches_of_epoch = list(order.chunk(cfg.num_minibatches))
        for idx in batches_of_epoch:
            terms = _minibatch_loss(policy, samples, idx, cfg, terms_fn)
            optimizers.actor.zero_grad(set_to_none=True)
            optimizers.critic.zero_grad(set_to_none=True)
            (terms["actor_loss"] + terms["critic_loss"]).backward()
            for g in policy.actors:
                terms[f"{g}/actor_grad_norm"] = grad_norm(actor_params[g], cfg.max_grad_norm)
                terms[f"{g}/critic_grad_norm"] = grad_norm(critic_params[g], cfg.max_grad_norm)
            optimizers.actor.step()
            optimizers.critic.step()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
            batches += 1
    return {k: float(v) / batches for k, v in sums.items()}


def _select(samples: Samples, idx: Tensor | None) -> Samples:
    """The chunks ``idx`` of ``samples`` (all of them, uncopied, when ``None``)."""
    if idx is None:
        return samples

    def take(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[:, idx]

    def pick(field: str, x: Tensor | None) -> Tensor | None:
        # Stored recurrent states are per chunk [M, ...]; everything else is [L, M, ...].
        return x[idx] if field in ("actor_state", "critic_state") else take(x)

    groups = {
        name: GroupSamples(**{f.name: pick(f.name, getattr(s, f.name)) for f in fields(s)})
        for name, s in samples.groups.items()
    }
    return Samples(groups, take(samples.starts), take(samples.valid), samples.padded)


def _minibatch_loss(
    policy: ActorCritic,
    samples: Samples,
    idx: Tensor | None,
    cfg: AlgoConfig,
    terms_fn: Callable[..., dict[str, Tensor]] | None = None,
) -> dict[str, Tensor]:
    """Loss terms of the chunks ``idx`` (all chunks when ``None``, without copying them).

    ValueNorm/PopArt statistics are updated with every mini-batch's targets before they are
    normalised, as in the paper's code; padding is left out of the statistics. PopArt rescales
    the value head in place, so this comes before the critic's forward pass, and outside
    ``terms_fn`` (:func:`loss_terms`, or its compiled form), which stays a pure function.
    """
    batch = _select(samples, idx)
    valid = batch.valid
    for name, s in batch.groups.items():
        policy.critics[name].update_normalizer(
            s.returns[valid.bool()] if batch.padded else s.returns
        )
    return (terms_fn or loss_terms)(policy, batch, cfg)


def loss_terms(policy: ActorCritic, batch: Samples, cfg: AlgoConfig) -> dict[str, Tensor]:
    """The loss terms of a mini-batch ``batch`` (already selected; normalisers already updated):
    ``actor_loss`` and ``critic_loss`` (to minimise) and per-group diagnostics. Pure: reads the
    networks, changes nothing, so that it can be compiled as one graph."""
    starts, valid = batch.starts, batch.valid
    terms: dict[str, Tensor] = {}
    actor_loss = torch.zeros((), device=starts.device)
    critic_loss = torch.zeros((), device=starts.device)
    for name, s in batch.groups.items():
        alive = s.alive  # [L, m, n]; also 0 on padding
        dist, _ = policy.actors[name](s.obs, s.actor_state, starts, s.action_mask, s.actor_inject)
        log_probs = dist.log_prob(s.actions)
        surrogate, ratio = policy_loss(log_probs, s.log_probs, s.advantages, cfg.clip)
        p_mask = alive if cfg.policy_active_masks else valid.unsqueeze(-1)
        pg = masked_mean(surrogate, p_mask)
        entropy = masked_mean(dist.entropy(), p_mask)

        critic = policy.critics[name]
        targets = critic.normalize(s.returns)  # [L, m, n]
        values, _ = critic(s.critic_x, s.critic_state, starts, s.critic_inject)
        n = s.returns.shape[-1]
        old_values = s.values.expand(-1, -1, n)
        v_loss_all = value_loss(values.expand(-1, -1, n), old_values, targets, cfg)
        v_mask = alive if cfg.value_active_masks else valid.unsqueeze(-1)
        v_loss = masked_mean(v_loss_all, v_mask)

        actor_loss = actor_loss + pg - cfg.entropy_coef * entropy
        critic_loss = critic_loss + cfg.value_coef * v_loss
        with torch.no_grad():
            log_ratio = log_probs - s.log_probs
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
