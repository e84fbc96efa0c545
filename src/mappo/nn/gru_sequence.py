"""A GRU over a whole sequence with its backward pass through time written out.

Autograd records the paper's GRU (``mappo.nn.layers.RecurrentCore``) as about twenty small
nodes per time step; where a step's tensors are small (a dozen rows of 128 units, JaxMARL's
recurrent settings) each node costs a dispatch of a few microseconds around very little
arithmetic, and the backward through a 128-step sequence costs several times the forward.
:class:`SequenceGRU` computes the same recurrence with six tensor ops per step forward and four
backward: every factor of the chain rule that does not depend on the incoming gradient is
formed in bulk over all steps first, and the weight and bias gradients after the loop as one
matrix product and one sum over all steps instead of one per step.

The equations are ``RecurrentCore._cell``'s (gates r, z, n; ``h' = n + z (h - n)``) with the
state multiplied by ``keep`` (0 where an episode starts) and ``inject`` added at the steps
listed in ``cuts``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class SequenceGRU(torch.autograd.Function):
    """``SequenceGRU.apply(gx, h0, weight, bias, keep, inject, cuts) -> out``.

    Args (``M`` rows, ``H`` hidden units, ``L`` steps):
        gx: ``[L, M, 3H]`` the input projection of every step, input bias included.
        h0: ``[M, H]`` the state before the first step.
        weight: ``[H, 3H]`` the hidden projection (``gh = h @ weight + bias``), gates r, z, n.
        bias: ``[3H]``.
        keep: ``[L, M, 1]`` the factor applied to the state before step ``t`` (read at ``cuts``
            only, no gradient).
        inject: ``[L, M, H]`` or ``None``, added to the state after ``keep`` at ``cuts`` (no
            gradient).
        cuts: the steps (Python ints) where ``keep`` or ``inject`` may differ from 1 and 0.
    Returns:
        ``[L, M, H]`` the state after each step (the GRU's output; the last row is the final
        state).

    ``h0`` and the output are saved for the backward, so neither may be changed in place
    before it (autograd raises if they are). First-order reverse mode only: no double
    backward, forward-mode AD or ``torch.func`` transforms (``RecurrentCore`` uses autograd's
    path there).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gx: Tensor,
        h0: Tensor,
        weight: Tensor,
        bias: Tensor,
        keep: Tensor,
        inject: Tensor | None,
        cuts: list[int],
    ) -> Tensor:
        L, M, G = gx.shape
        H = G // 3
        out = gx.new_empty(L, M, H)
        gh_all = gx.new_empty(L, M, G)  # the hidden projection of every step
        rz_all = gx.new_empty(L, M, 2 * H)  # gates r, z (after the sigmoid)
        n_all = gx.new_empty(L, M, H)
        cut = set(cuts)
        reset: list[Tensor] = []  # the state read at each cut (after keep and inject)
        # Views of every step made in bulk (one call each): indexing per step would cost more
        # than the step's arithmetic.
        steps = zip(
            gx[..., : 2 * H].unbind(0),
            gx[..., 2 * H :].unbind(0),
            gh_all.unbind(0),
            rz_all.unbind(0),
            n_all.unbind(0),
            out.unbind(0),
            strict=True,
        )
        h = h0
        for t, (gx_rz, gx_n, gh, rz, n, h_out) in enumerate(steps):
            if t in cut:
                h = h * keep[t]
                if inject is not None:
                    h = h + inject[t]
                reset.append(h)
            torch.addmm(bias, h, weight, out=gh)
            torch.add(gx_rz, gh[:, : 2 * H], out=rz).sigmoid_()
            torch.addcmul(gx_n, rz[:, :H], gh[:, 2 * H :], out=n).tanh_()
            h = torch.lerp(n, h, rz[:, H:], out=h_out)
        resets = torch.stack(reset) if reset else gx.new_empty(0, M, H)
        ctx.save_for_backward(weight, keep, h0, gh_all, rz_all, n_all, out, resets)
        ctx.cuts = sorted(cut)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        weight, keep, h0, gh_all, rz_all, n_all, out, resets = ctx.saved_tensors
        L, M, H = n_all.shape
        # The state each step read: the previous output, or what the cut made of it.
        prev_all = torch.cat([h0.reshape(1, M, H), out[:-1]])
        if ctx.cuts:
            prev_all[ctx.cuts] = resets
        cuts = set(ctx.cuts)
        r, z, hn = rz_all[..., :H], rz_all[..., H:], gh_all[..., 2 * H :]
        # With g = dL/dh' at a step, every gate's gradient is g times a factor that does not
        # depend on g, formed here in bulk over all steps: d(n's input) = g (1 - z)(1 - n^2),
        # d(r's input) = that times hn r (1 - r), d(z's input) = g (h - n) z (1 - z), and the
        # hidden projection's n part gets d(n's input) times r. ``p`` holds the hidden
        # projection's three factors, ``q`` the input projection's.
        a = (1 - z) * (1 - n_all * n_all)
        rz_factors = torch.cat([a * hn * r * (1 - r), (prev_all - n_all) * z * (1 - z)], -1)
        p = torch.cat([rz_factors, a * r], -1).view(L, M, 3, H)
        q = torch.cat([rz_factors, a], -1).view(L, M, 3, H)
        g_all = dout.new_empty(L, M, H)  # g per step
        dgh_all = dout.new_empty(L, M, 3 * H)  # d(hidden projection) per step
        w_t = weight.T  # [3H, H]
        dh = dout.new_zeros(M, H)
        steps = zip(
            dout.unbind(0),
            g_all.unbind(0),
            dgh_all.unbind(0),
            p.unbind(0),
            z.unbind(0),
            strict=True,
        )
        for t, (d_out, g, dgh, p_t, z_t) in reversed(list(enumerate(steps))):
            torch.add(dh, d_out, out=g)
            torch.mul(g.unsqueeze(1), p_t, out=dgh.view(M, 3, H))
            dh = torch.addmm(g * z_t, dgh, w_t)  # h' = n + z (h - n): z g reaches h directly
            if t in cuts:
                dh = dh * keep[t]
        need_gx, need_h0, need_w, need_b = ctx.needs_input_grad[:4]
        dweight = prev_all.reshape(L * M, H).T @ dgh_all.reshape(L * M, 3 * H) if need_w else None
        dbias = dgh_all.sum((0, 1)) if need_b else None
        dgx = (g_all.unsqueeze(2) * q).view(L, M, 3 * H) if need_gx else None
        dh0 = dh.reshape(h0.shape) if need_h0 else None
        return dgx, dh0, dweight, dbias, None, None, None
