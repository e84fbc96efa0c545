"""Policy distributions: masked categoricals with one or several independent heads, and a
diagonal Gaussian for continuous actions (:class:`DiagGaussian`, at the end).

A discrete action space with heads ``nvec = (n_1, ..., n_k)`` (``Discrete(5)`` is ``(5,)``, the
particle world's move + message is ``(5, 10)``) is parameterised by flat logits
``[..., sum(nvec)]``: head ``h`` owns the slice ``[offset_h, offset_h + n_h)``. An action is one
integer per head, ``[..., k]`` int64, and the joint distribution is the product of the heads, so
log-probabilities and entropies are sums over heads.

Internally the logits are laid out as ``[..., k, M]`` with ``M = max(nvec)``: a view when there is
one head or all heads have the same size, a single gather (plus padding with the most negative
float) otherwise. Every operation is then one batched op over all heads, with no Python loop and
no split/concatenate in the hot path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor


@functools.lru_cache(maxsize=64)
def _padded_layout(nvec: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Index tensors for heads of different sizes, built once per ``(nvec, device)``.

    Returns ``(gather_index [k * M], pad_valid [k, M], flat_valid [sum(nvec)])``:
    ``gather_index`` maps each slot of the padded ``[k, M]`` layout to a position of the flat
    logits (padding slots point at position 0 and are overwritten); ``pad_valid`` is True on real
    actions; ``flat_valid`` lists the padded slots of the real actions in flat order. Caching keeps
    host-to-device copies out of the per-step path.
    """
    width = max(nvec)
    gather, valid, flat = [], [], []
    offset = 0
    for h, n in enumerate(nvec):
        gather += [offset + i if i < n else 0 for i in range(width)]
        valid += [i < n for i in range(width)]
        flat += [h * width + i for i in range(n)]
        offset += n
    return (
        torch.tensor(gather, dtype=torch.int64, device=device),
        torch.tensor(valid, dtype=torch.bool, device=device).view(len(nvec), width),
        torch.tensor(flat, dtype=torch.int64, device=device),
    )


class MultiCategorical:
    """Independent categorical heads over flat logits, with optional action masks.

    Args:
        logits: ``[..., sum(nvec)]`` float, unnormalised log-probabilities.
        nvec: head sizes, e.g. ``(5,)`` or ``(5, 10)``.
        mask: optional ``[..., sum(nvec)]`` bool, ``True`` = allowed.

    Masked actions get probability exactly zero and receive no gradient: their logits are
    replaced by the most negative finite float (``torch.where``, so the gradient into them is
    zero) before a per-head log-softmax. Entropy counts masked actions as ``0 * log 0 = 0`` and
    stays finite, with finite gradients.

    A head whose actions are all masked is not an error in the hot path (checking it would need a
    device-to-host sync): such a head behaves as uniform over all of its actions, and ``mode``
    returns its action 0. Call :meth:`validate` (e.g. in tests or a debug run) to raise a
    ``ValueError`` instead.
    """

    def __init__(self, logits: Tensor, nvec: tuple[int, ...], mask: Tensor | None = None) -> None:
        nvec = tuple(int(n) for n in nvec)
        total = sum(nvec)
        if not nvec or min(nvec) < 1:
            raise ValueError(f"nvec must be a non-empty tuple of positive head sizes, got {nvec}")
        if logits.shape[-1:] != (total,):
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}, expected [..., {total}] "
                f"(the sum of the head sizes {nvec})"
            )
        if mask is not None and mask.shape != logits.shape:
            raise ValueError(
                f"mask has shape {tuple(mask.shape)}, expected the logits' shape "
                f"{tuple(logits.shape)} (bool, True = allowed)"
            )
        self.nvec = nvec
        self.batch_shape = logits.shape[:-1]
        self._mask = mask
        k, width = len(nvec), max(nvec)
        fill = torch.finfo(logits.dtype).min
        if mask is not None:
            logits = torch.where(mask, logits, fill)
        self._flat_valid: Tensor | None = None
        self._logp_cache: Tensor | None = None
        if width * k == total:
            # One head, or heads of equal size: the padded layout is a view (a reshape).
            self._logits = logits.reshape(*self.batch_shape, k, width)
        else:
            # While tracing, the uncached function: its index tensors become the graph's
            # constants either way, and torch >= 2.14 warns about tracing through a cache.
            layout = _padded_layout.__wrapped__ if torch.compiler.is_compiling() else _padded_layout
            gather, pad_valid, self._flat_valid = layout(nvec, logits.device)
            padded = logits.index_select(-1, gather).view(*self.batch_shape, k, width)
            self._logits = torch.where(pad_valid, padded, fill)

    @property
    def _logp(self) -> Tensor:
        """``[..., k, M]`` per-head log-probabilities; masked and padding slots ~ ``finfo.min``.
        Computed once (a plain attribute, not ``functools.cached_property``, whose lock
        ``torch.compile`` cannot trace)."""
        if self._logp_cache is None:
            self._logp_cache = self._log_softmax()
        return self._logp_cache

    def _log_softmax(self) -> Tensor:
        # log_softmax spelled out: on the CPU torch's fused kernel is slow over the tiny last dim
        # of an action head (measured ~3x slower, forward and backward, at 12k rows x 5 actions).
        # The max is detached: the result does not depend on the shift, so the gradient is exact.
        z = self._logits
        y = z - z.detach().amax(-1, keepdim=True)
        return y - y.exp().sum(-1, keepdim=True).log()

    @property
    def probs(self) -> Tensor:
        """``[..., sum(nvec)]`` per-head probabilities (each head's slice sums to 1)."""
        p = self._logp.exp().flatten(-2)
        if self._flat_valid is not None:
            p = p.index_select(-1, self._flat_valid)
        return p

    def sample(
        self, generator: torch.Generator | None = None, noise: Tensor | None = None
    ) -> Tensor:
        """``[..., k]`` int64 actions drawn with the Gumbel-max trick.

        ``argmax(logits + g)`` per head, ``g = -log(-log u)``, ``u ~ U[tiny, 1)`` drawn from
        ``generator`` only (torch's global RNG when ``None``), or given as ``noise``
        (``[..., k, max(nvec)]``, uniform in [0, 1): the compiled path draws it outside its
        graph, the same numbers in the same order). Clamping ``u`` away from 0 keeps ``g``
        finite, so an allowed action can never lose to a masked one (logit ``finfo.min``).
        """
        z = self._logits
        u = (
            torch.rand(z.shape, generator=generator, dtype=z.dtype, device=z.device)
            if noise is None
            else noise
        )
        gumbel = u.clamp(min=torch.finfo(z.dtype).tiny).log_().neg_().log_().neg_()
        # max(-1).indices: same first-maximum rule as argmax, ~1.5x faster on tiny CPU rows.
        return (z.detach() + gumbel).max(-1).indices

    def mode(self) -> Tensor:
        """``[..., k]`` int64 greedy actions (the most probable allowed action of each head)."""
        return self._logits.detach().max(-1).indices

    def log_prob(self, actions: Tensor) -> Tensor:
        """``[...]`` joint log-probability (sum over heads) of ``actions`` ``[..., k]`` int64.

        For a single head, ``actions`` may also be ``[...]``.
        """
        if len(self.nvec) == 1 and actions.shape == self.batch_shape:
            actions = actions.unsqueeze(-1)
        if actions.shape != (*self.batch_shape, len(self.nvec)):
            raise ValueError(
                f"actions have shape {tuple(actions.shape)}, expected "
                f"{(*self.batch_shape, len(self.nvec))} (batch..., heads)"
            )
        return self._logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1).sum(-1)

    def entropy(self) -> Tensor:
        """``[...]`` joint entropy in nats (sum over heads); masked actions contribute 0."""
        logp = self._logp
        # Masked slots have p = 0 and log p ~ finfo.min: 0 * finfo.min is 0 in the forward pass,
        # but its gradient overflows to inf once an upstream gradient exceeds 1 (and inf * 0 is
        # nan). Clamping log p at -1e4 changes nothing else: exp(-1e4) is exactly 0 in every
        # float dtype, so any clamped slot has p = 0 and contributes 0 with zero gradient anyway.
        return -(logp.exp() * logp.clamp(min=-1e4)).flatten(-2).sum(-1)

    def validate(self) -> None:
        """Raise ``ValueError`` if some head has every action masked (syncs with the device)."""
        if self._mask is None:
            return
        heads = self._mask.split(self.nvec, dim=-1)
        empty = ~torch.stack([h.any(-1) for h in heads], dim=-1)
        if bool(empty.any()):
            idx = tuple(int(i) for i in empty.nonzero()[0])
            raise ValueError(
                f"action mask forbids every action of head {idx[-1]} (size "
                f"{self.nvec[idx[-1]]}) at batch index {idx[:-1]}; every head needs at least one "
                "allowed action"
            )


_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class DiagGaussian:
    """A diagonal Gaussian policy over a box of continuous actions, with one of two ways to
    respect the box.

    Args:
        mean: ``[..., d]`` float, the mean of the Gaussian before any squashing.
        log_std: ``[..., d]`` (or broadcastable to it) log standard deviation.
        low, high: ``[d]`` bounds of the box (``-inf``/``inf`` allowed with ``"clip"``).
        bounds: ``"clip"``: the Gaussian's sample ``u`` is the action, clipped to the box only
            on its way to the env (:meth:`to_env`), as in the MAPPO paper's code and most PPO
            implementations; log-probabilities are those of ``u``. ``"tanh"``: the env gets
            ``a = low + (tanh(u) + 1) (high - low) / 2``, and :meth:`log_prob` is the density of
            ``a``: the Gaussian's minus ``sum log |da/du|`` (the change of variables of Haarnoja
            et al. 2018, "Soft Actor-Critic", appendix C).

    In both modes the stored action is the pre-squash sample ``u`` ``[..., d]``: the PPO ratio
    needs the log-probability of exactly what was drawn, and ``atanh`` of a squashed action at
    the bound would be infinite. :meth:`entropy` is the Gaussian's (closed form); with
    ``"tanh"`` the squashed density has none, and the Gaussian's entropy is the usual stand-in
    for the bonus (it rewards a wider ``u``).
    """

    def __init__(
        self, mean: Tensor, log_std: Tensor, low: Tensor, high: Tensor, bounds: str = "clip"
    ) -> None:
        if bounds not in ("clip", "tanh"):
            raise ValueError(f"bounds must be 'clip' or 'tanh', got {bounds!r}")
        self.mean = mean
        self.log_std = log_std.expand_as(mean)
        self.low, self.high = low, high
        self.bounds = bounds
        self.batch_shape = mean.shape[:-1]

    @property
    def std(self) -> Tensor:
        return self.log_std.exp()

    @property
    def _half_span(self) -> Tensor:
        """``(high - low) / 2``, computed so that bounds near the float maximum do not overflow."""
        return self.high / 2.0 - self.low / 2.0

    def sample(
        self, generator: torch.Generator | None = None, noise: Tensor | None = None
    ) -> Tensor:
        """``[..., d]`` pre-squash actions ``u = mean + std * z``, ``z`` drawn from
        ``generator`` only (torch's global RNG when ``None``), or given as ``noise``
        (``[..., d]``, standard normal)."""
        z = (
            torch.randn(
                self.mean.shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
            )
            if noise is None
            else noise
        )
        return (self.mean + self.std * z).detach()

    def mode(self) -> Tensor:
        """``[..., d]`` the most likely pre-squash action: the mean (deterministic evaluation)."""
        return self.mean.detach()

    def log_prob(self, actions: Tensor) -> Tensor:
        """``[...]`` log-density of pre-squash actions ``u`` ``[..., d]`` (summed over
        components); with ``"tanh"``, the density of the squashed action the env received."""
        if actions.shape != self.mean.shape:
            raise ValueError(
                f"actions have shape {tuple(actions.shape)}, expected {tuple(self.mean.shape)} "
                "(batch..., components)"
            )
        z = (actions - self.mean) / self.std
        logp = -0.5 * z.square() - self.log_std - _LOG_SQRT_2PI
        if self.bounds == "tanh":
            # log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)): exact and finite for any u,
            # where 1 - tanh(u)^2 underflows to 0 already at |u| ~ 9 in float32.
            log_dtanh = 2.0 * (math.log(2.0) - actions - F.softplus(-2.0 * actions))
            logp = logp - log_dtanh - torch.log(self._half_span)
        return logp.sum(-1)

    def entropy(self) -> Tensor:
        """``[...]`` the Gaussian's entropy in nats, ``sum(log std + log sqrt(2 pi e))``."""
        return (self.log_std + 0.5 + _LOG_SQRT_2PI).sum(-1)

    def to_env(self, actions: Tensor) -> Tensor:
        """``[..., d]`` the actions the env receives: ``u`` clipped to the box, or squashed."""
        if self.bounds == "tanh":
            # From the middle, so that bounds near the float maximum do not overflow (low +
            # (tanh + 1) * half does); the clip only catches rounding one ulp past a bound.
            middle = self.high / 2.0 + self.low / 2.0
            actions = middle + torch.tanh(actions) * self._half_span
        return torch.maximum(torch.minimum(actions, self.high), self.low)
