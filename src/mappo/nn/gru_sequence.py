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

On a CPU, for float32 and float64, the loops over time run in C (``gru_native.c``, compiled on
first use like Hanabi's step, :mod:`mappo.native_build`): even six tensor ops a step cost tens
of microseconds of Python and dispatch against a few microseconds of arithmetic at a dozen
rows. The C loops compute every gate gradient inline, so the bulk factors are not needed there
either. Where no C compiler works, or with :data:`NATIVE` off, the torch loops below run.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mappo import native_build

NATIVE = True
"""Whether the loops run in C where the library builds (``False``: the torch loops)."""

_SOURCE = Path(__file__).with_name("gru_native.c")
_TYPES = {torch.float32: "float", torch.float64: "double"}
_FLAGS = (
    "-O3",
    "-std=c11",
    "-shared",
    "-fPIC",
    # FMA contraction and no errno or trap semantics: what lets the loops vectorise
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wno-psabi",
)
_lock = threading.Lock()
_libraries: dict[torch.dtype, ctypes.CDLL | None] = {}
_reason: str | None = None


def native_library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The C loops for ``dtype`` (float32 or float64), built and loaded once per process, or
    ``None`` where they cannot be (another dtype, :data:`NATIVE` off, no working compiler:
    :func:`unavailable_reason` says why)."""
    global _reason
    if not NATIVE or dtype not in _TYPES:
        return None
    with _lock:
        if dtype not in _libraries:
            # for this CPU's instruction sets (the library named by what -march=native means
            # to the compiler), else for the architecture's baseline; with torch's libgomp,
            # built to share its threads
            arch = [([], "")]
            try:
                arch.insert(0, (["-march=native"], native_build.native_target()))
            except (OSError, RuntimeError, subprocess.SubprocessError):
                pass  # a compiler without -march=native: the baseline build only
            openmp = [["-fopenmp"], []] if native_build.torch_uses_libgomp() else [[]]
            candidates = [
                ((*_FLAGS, *a, *o, f"-DREAL={_TYPES[dtype]}"), k) for a, k in arch for o in openmp
            ]
            lib, why = native_build.load_first(_SOURCE, "gru", candidates)
            if lib is None:
                _reason = why
                native_build.note_fallback(
                    "the GRU's C loops",
                    why,
                    "recurrent networks on the CPU train with torch's loops, about half as fast",
                )
            else:
                i64, p = ctypes.c_int64, ctypes.c_void_p
                c_int = ctypes.c_int
                lib.gru_forward.argtypes = [c_int, i64, i64, i64, *[p] * 13]
                lib.gru_backward.argtypes = [c_int, i64, i64, i64, *[p] * 12]
                lib.gru_forward.restype = lib.gru_backward.restype = None
            _libraries[dtype] = lib
        return _libraries[dtype]


def unavailable_reason() -> str | None:
    """Why :func:`native_library` found no library (``None`` if it has not tried or it
    loaded)."""
    return _reason


def _threads(rows: int) -> int:
    """Threads for ``rows`` rows: the C loops split them in tiles of four, one share per
    thread (a forked child runs on one: its OpenMP team is its parent's)."""
    return 1 if native_build.forked() else max(1, min(torch.get_num_threads(), (rows + 3) // 4))


def _ptr(x: Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


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

    With the torch loops ``h0`` and the output are saved for the backward, so neither may be
    changed in place before it (autograd raises if they are); the C loops save copies of their
    own. Every tensor argument has ``gx``'s dtype (where one does not, the torch loops run and
    torch's type checks apply). First-order reverse mode only: no double backward, forward-mode
    AD or ``torch.func`` transforms (``RecurrentCore`` uses autograd's path there).
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
        same = all(t.dtype == gx.dtype for t in (h0, weight, bias, keep, inject) if t is not None)
        lib = native_library(gx.dtype) if gx.device.type == "cpu" and same else None
        if lib is not None:
            return _native_forward(ctx, lib, gx, h0, weight, bias, keep, inject, cuts)
        ctx.native = None
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
        if ctx.native is not None:
            return _native_backward(ctx, dout)
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
        w_t = weight.T.contiguous()  # [3H, H]: a transposed view makes each product 3x slower
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


def _native_forward(
    ctx: Any,
    lib: ctypes.CDLL,
    gx: Tensor,
    h0: Tensor,
    weight: Tensor,
    bias: Tensor,
    keep: Tensor,
    inject: Tensor | None,
    cuts: list[int],
) -> Tensor:
    """:meth:`SequenceGRU.forward` in ``gru_native.c``; saves what its backward reads."""
    L, M, G = gx.shape
    H = G // 3
    # the C code reads raw memory: every array contiguous (all of gx's dtype, checked above)
    gx, h0, weight, bias = (t.contiguous() for t in (gx, h0, weight, bias))
    keep = keep.reshape(L, M).contiguous()
    inject = None if inject is None else inject.contiguous()
    cut = torch.zeros(L, dtype=torch.uint8)
    cut[sorted(set(cuts))] = 1
    out, prev, n, hn = (gx.new_empty(L, M, H) for _ in range(4))
    rz = gx.new_empty(L, M, 2 * H)
    scratch = gx.new_empty(M, G)
    tensors = (gx, h0, weight, bias, keep, inject, cut, out, prev, rz, n, hn, scratch)
    lib.gru_forward(_threads(M), L, M, H, *map(_ptr, tensors))
    ctx.native, ctx.h0_shape = lib, h0.shape
    ctx.save_for_backward(weight, keep, cut, prev, rz, n, hn)
    return out


def _native_backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    """:meth:`SequenceGRU.backward` in ``gru_native.c``: the loop gives the gradients of the
    input projection and of every step's hidden projection; the weight's and the bias's are
    then one matrix product and one sum over all steps."""
    weight, keep, cut, prev, rz, n, hn = ctx.saved_tensors
    L, M, H = n.shape
    dout = dout.contiguous()
    w_t = weight.T.contiguous()  # [3H, H]: the loop's product reads rows
    dgx, dgh = (dout.new_empty(L, M, 3 * H) for _ in range(2))
    dh, scratch = dout.new_empty(M, H), dout.new_empty(M, H)
    tensors = (dout, w_t, keep, cut, prev, rz, n, hn, dgx, dgh, dh, scratch)
    ctx.native.gru_backward(_threads(M), L, M, H, *map(_ptr, tensors))
    need_gx, need_h0, need_w, need_b = ctx.needs_input_grad[:4]
    dweight = prev.reshape(L * M, H).T @ dgh.reshape(L * M, 3 * H) if need_w else None
    dbias = dgh.sum((0, 1)) if need_b else None
    dh0 = dh.reshape(ctx.h0_shape) if need_h0 else None
    return dgx if need_gx else None, dh0, dweight, dbias, None, None, None
