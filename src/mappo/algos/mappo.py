"""The MAPPO update, in one file: returns, flattening into chunks, the loss and the optimiser step.

The loss follows Yu et al. (2022), "The Surprising Effectiveness of PPO in Cooperative
Multi-Agent Games", and its code: a clipped surrogate with an entropy bonus for the actors; a
clipped, Huber (delta 10) value loss on normalised targets (ValueNorm or PopArt) for the critics;
active masks so that dead agents do not count; separate gradient-norm clipping of each network;
separate Adam optimisers for actors and critics. MAPPO, IPPO and their recurrent forms differ only
in the critic's input and the presence of the recurrent layer (see :mod:`mappo.nn.actor_critic`).

One difference from that code: an action of several discrete heads (Reference's move and
message) has one ratio, of the joint probability, clipped once, and the sum of the heads'
entropies as its entropy. The paper's code clips each head's ratio on its own, sums the clipped
terms over the heads and averages the heads' entropies (its ``act.py`` itself flags the per-head
log-probabilities as possibly wrong); on Reference our curve stays within 1-2 points of the
paper code's (RESULTS.md).

Shapes: ``T`` rollout steps, ``E`` envs, ``n`` agents of a group, ``C`` critic copies, ``L`` chunk
length (1 for feed-forward networks), ``M`` chunks (samples) of the update.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mappo.algos.returns import gae, next_values, td_lambda
from mappo.config import AlgoConfig
from mappo.data import Rollout, field_layout
from mappo.nn.actor_critic import ActorCritic
from mappo.nn.layers import traced

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
        # An agent whose own episode ended (envs that report it) is terminal from there, even
        # where its env goes on or was truncated: its next value would be that of its
        # death-masked input, which no loss trains.
        ended = term if buf.agent_terminated is None else term | buf.agent_terminated
        out[name] = estimator(
            buf.rewards, values[:-1].contiguous(), nxt, ended, trunc, cfg.gamma, cfg.gae_lambda
        )
    return out


def normalized_advantages(adv: Tensor, alive: Tensor, per_agent: bool) -> Tensor:
    """``adv [T, E, n]`` less its mean, over its standard deviation, both over the steps where
    the agent was alive (``alive [T, E, n]`` bool; the paper's active-masked normalisation).
    One set of statistics per group, each agent's own where ``per_agent`` (networks not shared):
    the MAPPO paper's code normalises each policy's buffer, so groups with rewards on other
    scales, or agents with networks of their own, do not shrink one another's advantages."""
    dims = (0, 1) if per_agent else (0, 1, 2)
    weight = alive.to(adv.dtype)
    alive_steps = weight.sum(dims, keepdim=True)
    count = alive_steps.clamp_min(1.0)
    mean = (adv * weight).sum(dims, keepdim=True) / count
    std = (((adv - mean) * weight).square().sum(dims, keepdim=True) / count).sqrt()
    # An agent (or group) never alive in the rollout has no statistics: its advantages, which
    # only policy_active_masks=false trains on, are 0 rather than divided by 1e-5.
    return torch.where(alive_steps > 0, (adv - mean) / (std + 1e-5), 0.0)


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


def make_samples(
    policy: ActorCritic,
    ro: Rollout,
    cfg: AlgoConfig,
    recurrent: bool,
    always_inject: bool = False,
) -> Samples:
    """Returns, advantage normalisation and chunking: the one place the rollout is flattened.

    Recurrent networks train on chunks of ``data_chunk_length`` steps that start from the stored
    recurrent state (the MAPPO paper's chunked recurrent training); where a chunk crosses into
    the next env, the state is reset there, to zeros at an episode start and to that env's stored
    state otherwise. Feed-forward networks use chunks of one step.

    ``always_inject``: give recurrent samples their injected states even where all are zero
    (``None`` otherwise, which the eager loss skips). A compiled loss is specialised on which
    it gets: with the tensor every time it compiles once instead of twice for envs whose
    episodes sometimes start with a rollout and sometimes not.
    """
    T, E = ro.starts.shape
    L = cfg.data_chunk_length if recurrent else 1
    dev = ro.starts.device
    returns = compute_returns(policy, ro, cfg)

    starts = _chunk(ro.starts, L)
    first_step = torch.zeros(T, E, dtype=torch.bool, device=dev)
    first_step[0] = True
    inject = _chunk(first_step, L) & ~starts
    inject[0] = False  # a chunk's first step already starts from the stored state
    # One host check per update: on aligned episodes (the particle world) nothing is injected.
    needs_inject = recurrent and (always_inject or bool(inject.any()))

    def injected(stored: Tensor) -> Tensor | None:
        if not needs_inject:
            return None
        return stored * inject.reshape(*inject.shape, 1, 1).to(stored.dtype)

    groups = {}
    for name, buf in ro.groups.items():
        adv, ret = returns[name]
        if cfg.normalize_advantages:
            adv = normalized_advantages(adv, buf.alive, policy.actors[name].copies > 1)
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


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a checkpoint's optimiser state (Adam's moments and step counts, RMSprop's averages)
    into ``opt``, keeping ``opt``'s own settings: the learning rates, ``eps``, weight decay and
    implementation flags it was built with from this run's config. torch's ``load_state_dict``
    would restore the saved ones too, so that a resume with lower learning rates (the advice
    after a divergence) trained on at the old ones while config.yaml named the new. The flags
    are set before loading, because torch places the step counters by them (on the
    parameters' device for fused Adam)."""
    groups = [
        {**old, **{k: v for k, v in new.items() if k != "params"}}
        for old, new in zip(saved["param_groups"], opt.param_groups, strict=True)
    ]
    opt.load_state_dict({**saved, "param_groups": groups})


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
            load_optimizer_state(opt, saved)

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


_ADAM_VARIANTS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")
"""``torch.optim.Adam`` options :func:`gradient_step` does not implement (refused when set)."""


class LossModule(torch.nn.Module):
    """:func:`loss_terms` as a module's forward, so that :func:`torch.func.functional_call` can
    run it on given parameters (:func:`gradient_step`). Holds the policy, adds nothing."""

    def __init__(self, policy: ActorCritic, cfg: AlgoConfig) -> None:
        super().__init__()
        self.policy = policy
        self.cfg = cfg

    def forward(self, batch: Samples) -> dict[str, Tensor]:
        return loss_terms(self.policy, batch, self.cfg)


@dataclass
class AdamSlots:
    """The tensors one gradient step reads and writes, in the order of
    ``LossModule.named_parameters()``: the parameters, and the Adam state torch keeps for each
    (first and second moments, the step count), so that a checkpoint is the same whichever path
    trained. ``networks`` lists ``(group, "actor" | "critic", indices)``: the parameters clipped
    together. ``lrs`` is ``[actor lr, critic lr]``, a float64 tensor (torch keeps the rate as a
    Python float) so that a decaying rate does not recompile the step. Every parameter is
    assumed to reach the loss (true of every actor and critic here): where eager Adam skips a
    parameter without a gradient, the gradient step would count a zero one."""

    names: tuple[str, ...]
    params: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    steps: list[Tensor]
    networks: tuple[tuple[str, str, tuple[int, ...]], ...]
    lrs: Tensor
    optimizers: Optimizers  # whose state the lists above are; for the eager fallback

    @classmethod
    def of(cls, loss: LossModule, optimizers: Optimizers) -> AdamSlots:
        """The slots of ``loss``'s parameters in ``optimizers``' state, creating the state as
        ``torch.optim.Adam`` does on its first step where it is missing. Called once per update:
        loading a checkpoint replaces the state's tensors."""
        names, params, avg, sq, steps = [], [], [], [], []
        networks: dict[tuple[str, str], list[int]] = {}
        by_param = {}
        for opt in (optimizers.actor, optimizers.critic):
            group = opt.param_groups[0]
            same = all(
                group[k] == optimizers.actor.param_groups[0][k]
                for k in ("betas", "eps", "weight_decay")
            )
            if any(group.get(k) for k in _ADAM_VARIANTS) or len(opt.param_groups) != 1 or not same:
                raise ValueError(
                    "the fused gradient step implements plain Adam with one set of betas, eps "
                    "and weight decay only"
                )
            for p in group["params"]:
                by_param[p] = opt
        for i, (name, p) in enumerate(loss.named_parameters()):
            opt = by_param[p]
            state = opt.state[p]
            if not state:
                # torch.optim.Adam's own initial state (a float32 step count, on the
                # parameter's device for fused Adam), so that either path resumes the other.
                fused = bool(opt.param_groups[0].get("fused"))
                where = p.device if fused else torch.device("cpu")
                wide = torch.get_default_dtype() == torch.float64
                dtype = torch.float64 if wide else torch.float32
                state["step"] = torch.zeros((), dtype=dtype, device=where)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            names.append(name)
            params.append(p)
            avg.append(state["exp_avg"])
            sq.append(state["exp_avg_sq"])
            steps.append(state["step"])
            _, kind, group_name = name.split(".")[:3]  # policy.actors.<group>. ...
            networks.setdefault((group_name, kind[:-1]), []).append(i)
        # On the parameters' device: a compiled CUDA step cannot read a CPU tensor's elements.
        lrs = torch.tensor(
            [optimizers.actor.param_groups[0]["lr"], optimizers.critic.param_groups[0]["lr"]],
            dtype=torch.float64,
            device=params[0].device,
        )
        return cls(
            tuple(names),
            params,
            avg,
            sq,
            steps,
            tuple((g, kind, tuple(idx)) for (g, kind), idx in networks.items()),
            lrs,
            optimizers,
        )


def gradient_step_key(loss: LossModule, slots: AdamSlots, batch: Samples, *hyper: Any) -> Hashable:
    """What tells the compiled calls of :func:`gradient_step` apart
    (:class:`mappo.compiled.DirectCalls`): the mini-batch's size and layout (a shorter last
    mini-batch, padding, injected recurrent states) and the optimiser's constants. The networks
    and Adam's state are the same tensors on every call of a trainer."""
    groups = tuple((name, field_layout(g)) for name, g in batch.groups.items())
    return batch.starts.shape, batch.padded, groups, hyper


def gradient_step(
    loss: LossModule,
    slots: AdamSlots,
    batch: Samples,
    max_grad_norm: float | None,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> dict[str, Tensor]:
    """One mini-batch's whole step as a pure-tensor function: the loss terms and their
    gradients (:func:`torch.func.grad`), each network's gradient-norm clipping and Adam, with the
    parameters and Adam's state updated in place. The same arithmetic as the eager step
    (``backward``, :func:`grad_norm`, ``torch.optim.Adam``), written so that ``torch.compile``
    makes it one graph: on the CPU the eager step's few hundred small calls per mini-batch
    (autograd's engine, zeroing, clipping, the optimisers) cost more than the small networks'
    arithmetic. Returns the loss terms and grad norms, as the eager loop records them."""

    def total(params: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        terms = torch.func.functional_call(loss, params, (batch,))
        return terms["actor_loss"] + terms["critic_loss"], terms

    params = dict(zip(slots.names, slots.params, strict=True))
    grads, terms = torch.func.grad(total, has_aux=True)(params)
    out = {k: v.detach() for k, v in terms.items()}
    beta1, beta2 = betas
    with torch.no_grad():
        for group, kind, idx in slots.networks:
            g = [grads[slots.names[i]] for i in idx]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
            if max_grad_norm is not None:
                # torch.nn.utils.clip_grad_norm_'s rule.
                coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
                g = [x * coef for x in g]
            out[f"{group}/{kind}_grad_norm"] = norm
            lr = slots.lrs[0 if kind == "actor" else 1]
            for i, grad in zip(idx, g, strict=True):
                p, step = slots.params[i], slots.steps[i]
                if weight_decay:
                    grad = grad + weight_decay * p
                step.add_(1.0)
                slots.exp_avg[i].lerp_(grad, 1.0 - beta1)
                slots.exp_avg_sq[i].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                # The bias corrections in double precision, as torch's fused Adam computes them.
                count = step.double()
                correction2 = (1.0 - beta2**count).sqrt().to(p.dtype)
                step_size = (lr / (1.0 - beta1**count)).to(p.dtype)
                denom = slots.exp_avg_sq[i].sqrt() / correction2 + eps
                p.sub_(step_size * slots.exp_avg[i] / denom)
    return out


def update(
    policy: ActorCritic,
    samples: Samples,
    optimizers: Optimizers,
    cfg: AlgoConfig,
    generator: torch.Generator,
    terms_fn: Callable[..., dict[str, Tensor]] | None = None,
    step_fn: Callable[..., dict[str, Tensor]] | None = None,
) -> dict[str, float]:
    """``cfg.epochs`` passes of ``cfg.num_minibatches`` mini-batches over ``samples``.

    ``terms_fn`` computes a mini-batch's loss terms (:func:`loss_terms` when ``None``; the
    compiled path passes its compiled form). ``step_fn``, when given, replaces the whole eager
    step after the normaliser update (:func:`gradient_step`, compiled). Returns the mean over
    mini-batches of the loss terms and diagnostics.
    """
    M = samples.starts.shape[1]
    sums: dict[str, Tensor] = {}
    batches = 0
    if step_fn is not None:
        loss = LossModule(policy, cfg)
        slots = AdamSlots.of(loss, optimizers)
        group = optimizers.actor.param_groups[0]
        hyper = (cfg.max_grad_norm, tuple(group["betas"]), group["eps"], group["weight_decay"])

    for _ in range(cfg.epochs):
        if cfg.num_minibatches == 1:
            # One full batch: its gradient does not depend on the order, so skip the shuffle
            # and the copies that indexing would make.
            batches_of_epoch: list[Tensor | None] = [None]
        else:
            order = torch.randperm(M, generator=generator).to(samples.starts.device)
            # exactly num_minibatches (chunk gives fewer where they do not divide M)
            batches_of_epoch = list(order.tensor_split(cfg.num_minibatches))
        for idx in batches_of_epoch:
            if step_fn is not None:
                terms = step_fn(loss, slots, _normalized_batch(policy, samples, idx), *hyper)
            else:
                terms = _minibatch_loss(policy, samples, idx, cfg, terms_fn)
                terms = _eager_step(terms, policy, optimizers, cfg.max_grad_norm)
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
            batches += 1
    return {k: float(v) / batches for k, v in sums.items()}


def _eager_step(
    terms: dict[str, Tensor],
    policy: ActorCritic,
    optimizers: Optimizers,
    max_grad_norm: float | None,
) -> dict[str, Tensor]:
    """Autograd's backward of a mini-batch's losses, each network's gradient-norm clipping and
    the optimisers' steps; ``terms`` with the gradient norms added."""
    optimizers.actor.zero_grad(set_to_none=True)
    optimizers.critic.zero_grad(set_to_none=True)
    (terms["actor_loss"] + terms["critic_loss"]).backward()
    for g in policy.actors:
        for kind, nets in (("actor", policy.actors), ("critic", policy.critics)):
            params = list(nets[g].parameters())
            terms[f"{g}/{kind}_grad_norm"] = grad_norm(params, max_grad_norm)
    optimizers.actor.step()
    optimizers.critic.step()
    return terms


def eager_gradient_step(
    loss: LossModule, slots: AdamSlots, batch: Samples, max_grad_norm: float | None, *_: Any
) -> dict[str, Tensor]:
    """:func:`gradient_step`'s eager counterpart, the step ``compile=off`` takes (autograd and
    ``torch.optim.Adam``): where compiling :func:`gradient_step` fails under ``compile=auto``
    (on its first call, as a missing compiler does), the run goes on with this and, with the
    rollout's functions fallen back too, learns exactly what an eager run learns."""
    return _eager_step(loss(batch), loss.policy, slots.optimizers, max_grad_norm)


def _select(samples: Samples, idx: Tensor | None) -> Samples:
    """The chunks ``idx`` of ``samples`` (all of them, uncopied, when ``None``)."""
    if idx is None:
        return samples

    # index_select, not x[:, idx]: the same rows, copied about twice as fast on a CPU (whole
    # rows at a time; the mini-batches of a wide observation are tens of megabytes)
    def take(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.index_select(1, idx)

    def pick(field: str, x: Tensor | None) -> Tensor | None:
        # Stored recurrent states are per chunk [M, ...]; everything else is [L, M, ...].
        if field in ("actor_state", "critic_state"):
            return None if x is None else x.index_select(0, idx)
        return take(x)

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
    return (terms_fn or loss_terms)(policy, _normalized_batch(policy, samples, idx), cfg)


def _normalized_batch(policy: ActorCritic, samples: Samples, idx: Tensor | None) -> Samples:
    """The chunks ``idx`` of ``samples``, after updating the critics' normalisers with their
    returns (see :func:`_minibatch_loss`)."""
    batch = _select(samples, idx)
    valid = batch.valid
    for name, s in batch.groups.items():
        policy.critics[name].update_normalizer(
            s.returns[valid.bool()] if batch.padded else s.returns
        )
    return batch


LOSS_ROWS_MAX_SHARE = 0.9
""":func:`loss_rows` selects rows only where at most this share of them is in the loss (the
selection copies the inputs of the rows it keeps)."""


def loss_rows(alive: Tensor, rowwise: bool) -> Tensor | None:
    """The agent rows (bool ``[L, m, n]``) that a network's active-masked loss term uses, where
    computing only those is exact and worth it; ``None`` to compute every row.

    A turn-based game leaves all but one player out of the losses at every step (Hanabi: half
    the rows with two players, three quarters with four), and a battle its dead agents. Where
    the network is ``rowwise`` (feed-forward, parameters shared), the losses over the selected
    rows equal the masked losses over all of them (up to the order of the sums), for a fraction
    of the compute. Eager CPU only: the selection reads the mask's count on the host, which a
    traced graph cannot and which would stall a GPU's queue; and not when ``alive`` holds
    weights other than 0 and 1."""
    if not rowwise or not alive.is_cpu or traced(alive):
        return None
    rows = alive > 0
    kept = int(rows.sum())
    if kept == 0 or kept > LOSS_ROWS_MAX_SHARE * rows.numel() or bool((alive[rows] != 1).any()):
        return None
    return rows


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
        actor = policy.actors[name]
        rows = loss_rows(alive, actor.rowwise and cfg.policy_active_masks)
        if rows is None:
            dist, _ = actor(s.obs, s.actor_state, starts, s.action_mask, s.actor_inject)
            log_probs = dist.log_prob(s.actions)
            old_log_probs, advantages = s.log_probs, s.advantages
            p_mask: Tensor | None = alive if cfg.policy_active_masks else valid.unsqueeze(-1)
        else:  # only the rows in the loss, every one weighted 1
            dist = actor.forward_rows(s.obs, rows, s.action_mask)
            log_probs = dist.log_prob(s.actions[rows])
            old_log_probs, advantages, p_mask = s.log_probs[rows], s.advantages[rows], None
        surrogate, ratio = policy_loss(log_probs, old_log_probs, advantages, cfg.clip)
        pg = masked_mean(surrogate, p_mask)
        entropy = masked_mean(dist.entropy(), p_mask)

        critic = policy.critics[name]
        targets = critic.normalize(s.returns)  # [L, m, n]
        n = s.returns.shape[-1]
        per_agent = s.values.shape[-1] == n  # one value per agent (not one per env, broadcast)
        rows = loss_rows(alive, critic.rowwise and cfg.value_active_masks and per_agent)
        if rows is None:
            values, _ = critic(s.critic_x, s.critic_state, starts, s.critic_inject)
            old_values = s.values.expand(-1, -1, n)
            v_loss_all = value_loss(values.expand(-1, -1, n), old_values, targets, cfg)
            v_mask = alive if cfg.value_active_masks else valid.unsqueeze(-1)
            v_loss = masked_mean(v_loss_all, v_mask)
        else:
            values = critic.forward_rows(s.critic_x, rows)
            v_loss = value_loss(values, s.values[rows], targets[rows], cfg).mean()

        actor_loss = actor_loss + pg - cfg.entropy_coef * entropy
        critic_loss = critic_loss + cfg.value_coef * v_loss
        with torch.no_grad():
            log_ratio = log_probs - old_log_probs
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
