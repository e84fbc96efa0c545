"""Value-target normalisers: ValueNorm and PopArt.

The MAPPO paper (Yu et al. 2022, "The Surprising Effectiveness of PPO in Cooperative Multi-Agent
Games") trains the critic on normalised targets. Its reference code keeps running
averages of the targets and of their squares as exponential moving averages with a debiasing
term (as Adam does for its moments):

    m   <- beta * m   + (1 - beta) * mean(x)        (one step per ``update`` call, not per sample)
    s   <- beta * s   + (1 - beta) * mean(x ** 2)
    d   <- beta * d   + (1 - beta)
    mean = m / max(d, epsilon)
    var  = max(s / max(d, epsilon) - mean ** 2, 1e-2),   std = sqrt(var)

with ``beta = 0.99999`` and ``epsilon = 1e-5``. The variance floor of ``1e-2`` (std >= 0.1) keeps
the first updates, and constant targets, from blowing normalised values up.

:class:`PopArt` (van Hasselt et al. 2016, "Learning values across many orders of magnitude") also
rescales the value head's last linear layer on every update so that its de-normalised outputs are
unchanged ("preserving outputs precisely").
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_VAR_FLOOR = 1e-2
"""Lower bound of the debiased variance, as in the MAPPO reference code."""


def _fits(target: tuple[int, ...], stats: tuple[int, ...]) -> bool:
    """Whether statistics of shape ``stats`` broadcast into a tensor of shape ``target``."""
    try:
        return tuple(torch.broadcast_shapes(target, stats)) == tuple(target)
    except RuntimeError:
        return False


class ValueNorm(nn.Module):
    """Normalises value targets by a running mean/std (the MAPPO paper's ValueNorm).

    Args:
        shape: shape of one normalised quantity: ``1`` (the default) for a scalar value stored
            as ``[..., 1]``, ``()`` for ``[...]``, or e.g. ``(n_agents, 1)`` for separate
            statistics per agent.
        beta: EMA decay applied once per :meth:`update` call.
        epsilon: lower bound of the debiasing term (guards the division before any update).

    The statistics are float32 buffers (``running_mean``, ``running_mean_sq`` of ``shape`` and a
    scalar ``debiasing_term``): they are saved in ``state_dict``, move with ``.to(device)``, and
    every method runs on the buffers' device with no host copies.
    """

    running_mean: Tensor
    running_mean_sq: Tensor
    debiasing_term: Tensor

    def __init__(
        self, shape: int | tuple[int, ...] = 1, beta: float = 0.99999, epsilon: float = 1e-5
    ) -> None:
        super().__init__()
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if epsilon <= 0.0:
            raise ValueError(f"epsilon must be positive, got {epsilon}")
        self.beta = float(beta)
        self.epsilon = float(epsilon)
        self.register_buffer("running_mean", torch.zeros(self.shape))
        self.register_buffer("running_mean_sq", torch.zeros(self.shape))
        self.register_buffer("debiasing_term", torch.zeros(()))

    def extra_repr(self) -> str:
        return f"shape={self.shape}, beta={self.beta}, epsilon={self.epsilon}"

    def reset(self) -> None:
        """Forget all statistics (mean 0, variance at its floor)."""
        self.running_mean.zero_()
        self.running_mean_sq.zero_()
        self.debiasing_term.zero_()

    def _batch_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mean of ``x`` and of ``x ** 2`` over every leading dim of ``x [..., *shape]``."""
        n = len(self.shape)
        if x.dim() < n or tuple(x.shape[x.dim() - n :]) != self.shape:
            raise ValueError(
                f"ValueNorm.update got shape {tuple(x.shape)}; expected [..., *{self.shape}] "
                f"(the trailing dims must equal the normaliser's shape)"
            )
        dims = tuple(range(x.dim() - n))
        x = x.detach().to(self.running_mean.dtype)
        if not dims:
            return x, x * x
        return x.mean(dims), (x * x).mean(dims)

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Fold a batch of targets ``x [..., *shape]`` into the statistics (one EMA step)."""
        mean, mean_sq = self._batch_moments(x)
        w = self.beta
        self.running_mean.mul_(w).add_(mean, alpha=1.0 - w)
        self.running_mean_sq.mul_(w).add_(mean_sq, alpha=1.0 - w)
        self.debiasing_term.mul_(w).add_(1.0 - w)

    def mean_std(self) -> tuple[Tensor, Tensor]:
        """Debiased ``(mean, std)``, each of ``shape``."""
        d = self.debiasing_term.clamp(min=self.epsilon)
        mean = self.running_mean / d
        var = (self.running_mean_sq / d - mean * mean).clamp(min=_VAR_FLOOR)
        return mean, var.sqrt()

    def normalize(self, x: Tensor) -> Tensor:
        """``(x - mean) / std`` for ``x [..., *shape]`` (differentiable in ``x``)."""
        mean, std = self.mean_std()
        return (x - mean) / std

    def denormalize(self, x: Tensor) -> Tensor:
        """``x * std + mean``, the inverse of :meth:`normalize`."""
        mean, std = self.mean_std()
        return torch.addcmul(mean, x, std)


class PopArt(ValueNorm):
    """ValueNorm whose update also rescales the value head so that its de-normalised outputs are
    preserved (van Hasselt et al. 2016, Sec. 2, "Preserving outputs precisely").

    The head computes normalised values ``y = x @ W + b`` with ``W [..., in, out]`` and
    ``b [..., out]`` (the layout of ``mappo.nn.layers.AgentLinear``: ``[C, in, 1]`` and
    ``[C, 1]``, ``C`` = 1 shared or one per agent). ``out`` and the leading dims must broadcast
    against the normaliser's ``shape``: ``shape=1`` (shared statistics) or ``shape=(C, 1)`` (one
    set per agent). For a ``torch.nn.Linear`` head (weight ``[out, in]``) pass
    ``linear.weight.mT``, a view, so the rescaling still lands in the layer's parameter.
    """

    @torch.no_grad()
    def update(self, x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> None:
        """Fold ``x [..., *shape]`` into the statistics, then rescale ``weight``/``bias`` in place:
        ``W <- W * old_std / new_std`` and ``b <- (old_std * b + old_mean - new_mean) / new_std``.
        """
        if weight is not None and not _fits(weight.shape[:-2] + weight.shape[-1:], self.shape):
            raise ValueError(
                f"PopArt: weight of shape {tuple(weight.shape)} ([..., in, out]) does not match "
                f"the normaliser's shape {self.shape}; pass an [..., in, out] weight "
                "(linear.weight.mT for an nn.Linear)"
            )
        if bias is not None and not _fits(bias.shape, self.shape):
            raise ValueError(
                f"PopArt: bias of shape {tuple(bias.shape)} ([..., out]) does not match the "
                f"normaliser's shape {self.shape}"
            )
        old_mean, old_std = self.mean_std()
        super().update(x)
        new_mean, new_std = self.mean_std()
        if weight is not None:
            scale = old_std / new_std
            # One scale per output column: [..., out] -> [..., 1, out] against W [..., in, out].
            weight.mul_(scale.unsqueeze(-2) if scale.dim() else scale)
        if bias is not None:
            bias.mul_(old_std).add_(old_mean - new_mean).div_(new_std)


def moment_dtype(device: torch.device) -> torch.dtype:
    """float64 for running moments, or float32 on a device without float64 (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


class RunningMeanStd(nn.Module):
    """Mean and variance of every value seen so far (Chan et al.'s parallel update of the
    moments, one batch at a time), as EPyMARL standardises rewards: ``(x - mean) / std``.

    The moments are buffers, so they are saved in ``state_dict`` and follow ``.to()``; float64
    on ``device``, or float32 where the device has no float64 (Apple's MPS), so that the module
    can be moved there.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, epsilon: float = 1e-4, device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        wide = moment_dtype(device)
        self.register_buffer("mean", torch.zeros((), dtype=wide, device=device))
        self.register_buffer("var", torch.ones((), dtype=wide, device=device))
        # A small prior count keeps the first standardisation finite, as EPyMARL's does.
        self.register_buffer("count", torch.tensor(epsilon, dtype=wide, device=device))

    def update(self, x: Tensor) -> None:
        """Fold the values ``x`` (any shape, at least one value) into the moments."""
        x = x.detach().to(self.mean.dtype)
        n = x.numel()
        batch_mean = x.mean()
        batch_var = x.var(unbiased=False)
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta.square() * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def standardise(self, x: Tensor) -> Tensor:
        return ((x - self.mean) / self.var.clamp_min(1e-8).sqrt()).to(x.dtype)
