"""Layers whose parameters are shared by a group's agents or held once per agent.

Every layer here maps ``[..., C, in]`` to ``[..., C, out]`` where ``C`` is the agent axis. With
``copies == 1`` one set of parameters serves every agent (parameter sharing, the MAPPO paper's
default); with ``copies == C`` agent ``i`` uses its own set, and all agents are still computed in
one batched matrix multiply rather than a Python loop over agents.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mappo.config import ConfigError
from mappo.data import channel_axis
from mappo.nn.gru_sequence import SequenceGRU, native_library


class AgentLinear(nn.Module):
    """``y[..., c, :] = x[..., c, :] @ W[c] + b[c]``; ``W`` is ``[copies, in, out]``."""

    def __init__(self, in_features: int, out_features: int, copies: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features, self.copies = in_features, out_features, copies
        self.weight = nn.Parameter(torch.empty(copies, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(copies, out_features))
        self.reset_parameters(gain=1.0)

    def reset_parameters(self, gain: float) -> None:
        """Orthogonal weights with ``gain`` and zero bias (the MAPPO paper's initialisation)."""
        with torch.no_grad():
            for w in self.weight:
                # nn.init.orthogonal_ works on [out, in]; transposing keeps the rows orthogonal
                # in the same sense as for nn.Linear.
                nn.init.orthogonal_(w.T, gain=gain)
            self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        if self.copies == 1:
            return F.linear(x, self.weight[0].T, self.bias[0])
        # [..., C, in] -> [C, M, in] @ [C, in, out] -> [..., C, out]
        lead = x.shape[:-2]
        xc = x.reshape(-1, self.copies, self.in_features).transpose(0, 1)
        y = torch.baddbmm(self.bias.unsqueeze(1), xc, self.weight)
        return y.transpose(0, 1).reshape(*lead, self.copies, self.out_features)


class AgentLayerNorm(nn.Module):
    """LayerNorm over the last axis with per-copy affine parameters ``[copies, features]``."""

    def __init__(self, features: int, copies: int = 1) -> None:
        super().__init__()
        self.features = features
        self.weight = nn.Parameter(torch.ones(copies, features))
        self.bias = nn.Parameter(torch.zeros(copies, features))

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.shape[0] == 1:
            return F.layer_norm(x, (self.features,), self.weight[0], self.bias[0])
        return F.layer_norm(x, (self.features,)) * self.weight + self.bias


def _activation(name: str) -> nn.Module:
    return {"relu": nn.ReLU(), "tanh": nn.Tanh()}[name]


def init_gain(activation: str) -> float:
    """The orthogonal-init gain for hidden layers: sqrt(2) for ReLU, 5/3 for Tanh."""
    return nn.init.calculate_gain(activation)


class MLP(nn.Module):
    """Input LayerNorm (the paper's feature normalisation), then ``Linear -> act -> LayerNorm``
    per hidden layer, as the MAPPO paper's ``MLPBase``. ``[..., C, in] -> [..., C, hidden[-1]]``."""

    def __init__(
        self,
        in_features: int,
        hidden_sizes: list[int],
        activation: str,
        copies: int,
        feature_norm: bool,
        layer_norm: bool,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if feature_norm:
            layers.append(AgentLayerNorm(in_features, copies))
        gain = init_gain(activation)
        size = in_features
        for hidden in hidden_sizes:
            linear = AgentLinear(size, hidden, copies)
            linear.reset_parameters(gain)
            layers += [linear, _activation(activation)]
            if layer_norm:
                layers.append(AgentLayerNorm(hidden, copies))
            size = hidden
        self.net = nn.Sequential(*layers)
        self.out_features = size

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def image_layout(
    shape: tuple[int, ...], layout: str, what: str, warn: bool = True
) -> tuple[int, int, int, bool]:
    """``(channels, height, width, channels_last)`` of a 3-D observation ``shape``.

    ``layout`` ``"auto"`` takes the channels from the end axis that is smaller than both others
    (:func:`~mappo.data.channel_axis`); Gymnasium and PettingZoo images are ``[H, W, C]``,
    torch's ``[C, H, W]``. ``what`` names the input in the error raised where the shape does not
    tell; ``warn``: warn where an explicit layout reads the end that looks like the channels
    as pixels."""
    if len(shape) != 3:
        raise ValueError(f"{what} has shape {tuple(shape)}; an image has three axes")
    if layout == "auto":
        axis = channel_axis(shape)
        if axis is None:
            raise ConfigError(
                f"{what} has shape {tuple(shape)}, whose colour-channel axis cannot be told "
                "from its sizes; set model.image_layout=hwc ([height, width, channels]) or "
                "model.image_layout=chw ([channels, height, width])"
            )
        layout = "hwc" if axis == 2 else "chw"
    elif warn and channel_axis(shape) == (0 if layout == "hwc" else 2):
        # the other end looks like the channels: most likely a layout set for other pictures
        warnings.warn(
            f"model.image_layout={layout} reads {what} of shape {tuple(shape)} as "
            f"{shape[2] if layout == 'hwc' else shape[0]} channels, but its "
            f"{'first' if layout == 'hwc' else 'last'} axis looks like the channels; check "
            "model.image_layout (auto finds it)",
            stacklevel=3,
        )
    if layout == "hwc":
        return shape[2], shape[0], shape[1], True
    return shape[0], shape[1], shape[2], False


def conv_maps(image: tuple[int, int, int], layers: list[tuple[int, int, int]]) -> int:
    """Values in the flattened output maps of ``layers`` (``(channels, kernel, stride)``, no
    padding) over an image of ``(channels, height, width)``; 0 where a kernel does not fit."""
    ch, h, w = image
    for out_ch, kernel, stride in layers:
        if kernel > min(h, w):
            return 0
        ch, h, w = out_ch, (h - kernel) // stride + 1, (w - kernel) // stride + 1
    return ch * h * w


class ConvEncoder(nn.Module):
    """Convolutions over an image input, for observations that are pictures.

    The input is the flat ``[..., C, in]`` vector the other layers read: its first
    ``image_size`` values are the image (``[H, W, ch]`` or ``[ch, H, W]`` flattened, see
    :func:`image_layout`), the rest (an agent id, a death mask's zeros) pass through.
    The image is scaled by ``scale`` (1/255 turns 8-bit pixels into [0, 1], as the MAPPO
    paper's ``CNNLayer`` divides by 255), then each ``(channels, kernel, stride)`` layer is an
    unpadded ``Conv2d`` followed by the activation; the last layer's maps are flattened and the
    passed-through values appended: ``[..., C, in] -> [..., C, out_features]``.

    With ``copies > 1`` each agent has its own filters: the agents' images become the channel
    groups of one grouped convolution (``groups=copies``), so all agents are still computed
    in one call, as :class:`AgentLinear` does with one batched product.
    """

    def __init__(
        self,
        in_features: int,
        shape: tuple[int, int, int, bool],
        layers: list[tuple[int, int, int]],
        activation: str,
        copies: int,
        scale: float,
        what: str = "the input",
    ) -> None:
        super().__init__()
        ch, h, w, self.channels_last = shape
        self.image = (ch, h, w)
        self.image_size = ch * h * w
        self.extra = in_features - self.image_size
        self.copies, self.scale = copies, scale
        convs: list[nn.Module] = []
        gain = init_gain(activation)
        for i, (out_ch, kernel, stride) in enumerate(layers):
            if kernel > h or kernel > w:
                layout = "hwc" if self.channels_last else "chw"
                raise ConfigError(
                    f"{what}: convolution {i + 1} of model.cnn_kernels has a {kernel}x{kernel} "
                    f"kernel but its input maps are {h}x{w} (the image read as {self.image[1]}x"
                    f"{self.image[2]} pixels of {self.image[0]} channels, {layout}); use smaller "
                    "kernels or strides, or fewer layers (or set model.image_layout if the "
                    "channels are on the other end)"
                )
            conv = nn.Conv2d(ch * copies, out_ch * copies, kernel, stride, groups=copies)
            with torch.no_grad():
                # each agent's filters on their own, as one set would be (orthogonal over its
                # [out, in * k * k] matrix, the paper's initialisation), bias zero
                for c in range(copies):
                    nn.init.orthogonal_(conv.weight[c * out_ch : (c + 1) * out_ch], gain=gain)
                conv.bias.zero_()
            convs += [conv, _activation(activation)]
            ch, h, w = out_ch, (h - kernel) // stride + 1, (w - kernel) // stride + 1
        self.net = nn.Sequential(*convs)
        self.maps = ch * h * w
        self.out_features = self.maps + self.extra

    def forward(self, x: Tensor) -> Tensor:
        ch, h, w = self.image
        P = self.copies
        flat = x.reshape(-1, P, x.shape[-1])  # [N, P, in]
        N = flat.shape[0]
        img = flat[..., : self.image_size] * self.scale
        if self.channels_last:
            img = img.reshape(N, P, h, w, ch).permute(0, 1, 4, 2, 3)
        maps = self.net(img.reshape(N, P * ch, h, w)).reshape(N, P, self.maps)
        if self.extra:
            maps = torch.cat([maps, flat[..., self.image_size :]], -1)
        return maps.reshape(*x.shape[:-1], self.out_features)


def traced(x: Tensor) -> bool:
    """Whether ``x`` is being traced (``torch.compile``) or batched by ``torch.func.vmap`` (the
    seed-stacked path): the fused path below reads which steps reset on the host, which
    neither allows."""
    return (
        torch.compiler.is_compiling()
        or torch._C._functorch.is_batchedtensor(x)
        or torch._C._functorch.peek_interpreter_stack() is not None  # vmapped parameters
    )


def _cut_steps(starts: Tensor, inject: Tensor | None) -> list[int]:
    """The steps (``starts`` ``[L, *B]``) where some row starts an episode or has a state
    injected (``inject`` ``[L, *B, C, S]`` nonzero): one host sync."""
    L = starts.shape[0]
    cuts = starts.reshape(L, -1).any(1)
    if inject is not None:
        cuts |= inject.reshape(L, -1).ne(0).any(1)
    return cuts.nonzero().flatten().tolist()


SEQUENCE_MAX_STEP = 2048
"""Rows x hidden units per step up to which training runs a GRU sequence in
:class:`~mappo.nn.gru_sequence.SequenceGRU`. Where steps are that small the cost is the number
of ops per step, which it cuts: JaxMARL's recurrent settings (12 rows x 128 units for the actor,
4 x 128 for the critic) trained 1.86x faster. With larger steps its bulk passes over all steps
cost more than they save: at 96 x 64 (a value-family batch of whole episodes) and 480-960 x 64
(the paper's chunks) autograd's path was 1.3-2x faster (BENCHMARKS.md, "Recurrent training").
That is the bound for its torch loops; where its loops run in C (a CPU, float32 or float64,
:func:`~mappo.nn.gru_sequence.native_library`) the bound is :data:`SEQUENCE_NATIVE_MAX_STEP`."""

SEQUENCE_NATIVE_MAX_STEP = 131072
"""The bound of :data:`SEQUENCE_MAX_STEP` where :class:`~mappo.nn.gru_sequence.SequenceGRU`'s
loops run in C: the C loops were faster than autograd's path from 4 x 128 (8.8x) through
960 x 64 (1.4x) to 2,048 x 64 and 1,024 x 128 (1.2-1.4x) rows x units, forward and backward of
a sequence on two threads (BENCHMARKS.md); beyond, torch's matrix products win."""


class RecurrentCore(nn.Module):
    """A GRU (the paper) or LSTM layer whose hidden state resets where an episode starts.

    The hidden state is a flat ``[..., C, state_size]`` tensor (``state_size`` = H for a GRU, 2H
    for an LSTM: ``[h, c]``), so storage and chunking treat both kinds alike. The input projection
    of a whole sequence is one matrix multiply and the recurrence loops over time, or (shared
    parameters, eager, on the CPU) runs in torch's fused kernel between resets, or (a GRU with
    shared parameters training eagerly on the CPU on small steps) in
    :class:`~mappo.nn.gru_sequence.SequenceGRU`.
    A LayerNorm follows the output, as in the paper's ``RNNLayer``.
    """

    def __init__(self, size: int, kind: str, copies: int, layer_norm: bool) -> None:
        super().__init__()
        if kind not in ("gru", "lstm"):
            raise ValueError(f"unknown recurrent kind '{kind}', expected 'gru' or 'lstm'")
        self.kind, self.size = kind, size
        gates = 3 if kind == "gru" else 4
        self.input_proj = AgentLinear(size, gates * size, copies)
        self.hidden_proj = AgentLinear(size, gates * size, copies)
        for layer in (self.input_proj, self.hidden_proj):
            layer.reset_parameters(gain=1.0)
        self.norm = AgentLayerNorm(size, copies) if layer_norm else nn.Identity()

    @property
    def state_size(self) -> int:
        return self.size if self.kind == "gru" else 2 * self.size

    def forward(
        self,
        x: Tensor,
        state: Tensor,
        starts: Tensor,
        inject: Tensor | None = None,
        whole_episodes: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Run a sequence.

        Args:
            x: ``[L, *B, C, H]`` inputs (``L`` time steps).
            state: ``[*B, C, state_size]`` hidden state before the first step.
            starts: ``[L, *B]`` bool/float, 1 where an episode starts at that step (the state is
                zeroed before it is used).
            inject: optional ``[L, *B, C, state_size]`` added to the state after that reset,
                to restore a stored state mid-sequence (zeros elsewhere).
            whole_episodes: the caller promises that episodes start only at the first step
                (whole stored episodes, as the value family trains on): with shared parameters
                the sequence then runs in torch's fused recurrent kernel, the same cell.
        Returns:
            ``([L, *B, C, H]`` outputs, ``[*B, C, state_size]`` final state).
        """
        shared = self.input_proj.copies == 1
        keep = (1.0 - starts.to(x.dtype)).unsqueeze(-1).unsqueeze(-1)  # [L, *B, 1, 1]
        eager_cpu = shared and x.shape[0] > 1 and x.is_cpu and not traced(x)
        if eager_cpu and self._trains(x, inject):
            # Eager training on the CPU with small steps: the backward through time written out
            # (mappo.nn.gru_sequence), fewer ops per step than autograd records.
            return self._sequence(x, state, keep, inject, _cut_steps(starts, inject))
        if whole_episodes and inject is None and shared:
            return self._segments(x, state, keep, None, [0])
        if eager_cpu:
            # Eager training on sequences: between steps where some row resets, the whole batch
            # runs in torch's fused kernel (the MAPPO paper's RNNLayer does the same). One host
            # sync finds those steps; where they are too many, the loop below is cheaper. CPU
            # only: on CUDA the fused kernel is cuDNN's, which may compute in TF32.
            where = sorted({0, *_cut_steps(starts, inject)})
            if len(where) <= x.shape[0] // 2:
                return self._segments(x, state, keep, inject, where)
        # unbind (not projected[t]): its backward is one stack, where indexing would zero-fill
        # a full-size gradient buffer for every time step.
        projected = self.input_proj(x).unbind(0)
        outputs = []
        injected = inject.unbind(0) if inject is not None else None
        for t, keep_t in enumerate(keep.unbind(0)):
            state = state * keep_t
            if injected is not None:
                state = state + injected[t]
            out, state = self._cell(projected[t], state)
            outputs.append(out)
        return self.norm(torch.stack(outputs)), state

    def _trains(self, x: Tensor, inject: Tensor | None) -> bool:
        """Whether this call records gradients for :class:`SequenceGRU` to compute: a GRU on
        small steps, with autograd on, through the input or the parameters, no gradient into
        ``inject``, and outside ``torch.func`` transforms (the gradient step's ``grad``, the
        stacked seeds' ``vmap``), which would need the Function's own rules for them."""
        return (
            self.kind == "gru"
            and torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")  # its out= buffers take the input's dtype
            and torch._C._functorch.peek_interpreter_stack() is None
            and (x.requires_grad or self.hidden_proj.weight.requires_grad)
            and (inject is None or not inject.requires_grad)
            and x[0].numel() <= self._sequence_bound(x.dtype)
        )

    @staticmethod
    def _sequence_bound(dtype: torch.dtype) -> int:
        """Rows x units per step up to which :class:`SequenceGRU` trains: higher where its
        loops run in C (the library is built on first use, so this is asked last)."""
        native = native_library(dtype) is not None
        return SEQUENCE_NATIVE_MAX_STEP if native else SEQUENCE_MAX_STEP

    def _sequence(
        self, x: Tensor, state: Tensor, keep: Tensor, inject: Tensor | None, cuts: list[int]
    ) -> tuple[Tensor, Tensor]:
        """The sequence in :class:`SequenceGRU` (rows of ``*B`` and ``C`` flattened); ``cuts``:
        the steps where some row resets or has a state injected."""
        L, H = x.shape[0], self.size
        gx = self.input_proj(x)
        M = gx[0].numel() // (3 * H)
        out = SequenceGRU.apply(
            gx.reshape(L, M, 3 * H),
            state.reshape(M, H),
            self.hidden_proj.weight[0],
            self.hidden_proj.bias[0],
            keep.expand(*x.shape[:-1], 1).reshape(L, M, 1),
            None if inject is None else inject.reshape(L, M, H),
            cuts,
        )
        return self.norm(out.reshape(x.shape)), out[-1].reshape(state.shape)

    def _segments(
        self, x: Tensor, state: Tensor, keep: Tensor, inject: Tensor | None, cuts: list[int]
    ) -> tuple[Tensor, Tensor]:
        """The sequence as runs of steps without resets, each in :meth:`_fused`; the state is
        reset (``keep [L, *B, 1, 1]``) and injected at each run's first step ``cuts``."""
        outputs = []
        for a, b in zip(cuts, [*cuts[1:], x.shape[0]], strict=True):
            state = state * keep[a]
            if inject is not None:
                state = state + inject[a]
            out, state = self._fused(x[a:b], state)
            outputs.append(out)
        return self.norm(torch.cat(outputs) if len(outputs) > 1 else outputs[0]), state

    def _fused(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """The whole sequence in ``torch.gru`` / ``torch.lstm`` (outputs before the LayerNorm):
        their gates come in the order of :meth:`_cell` (r, z, n and i, f, g, o) with the same
        equations, so the weights are used as they are."""
        L, lead, H = x.shape[0], x.shape[1:-1], self.size
        weights = [
            self.input_proj.weight[0].T,
            self.hidden_proj.weight[0].T,
            self.input_proj.bias[0],
            self.hidden_proj.bias[0],
        ]
        seq = x.reshape(L, -1, x.shape[-1])
        if self.kind == "gru":
            out, h = torch.gru(
                seq, state.reshape(1, -1, H), weights, True, 1, 0.0, True, False, False
            )
            new_state = h.reshape(*lead, H)
        else:
            h0, c0 = state.reshape(1, -1, 2 * H).chunk(2, -1)
            out, h, c = torch.lstm(
                seq, (h0.contiguous(), c0.contiguous()), weights, True, 1, 0.0, True, False, False
            )
            new_state = torch.cat([h, c], -1).reshape(*lead, 2 * H)
        return out.reshape(L, *lead, H), new_state

    def _cell(self, gx: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        if self.kind == "gru":
            gh = self.hidden_proj(state)
            xr, xz, xn = gx.chunk(3, -1)
            hr, hz, hn = gh.chunk(3, -1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = n + z * (state - n)
            return h, h
        h, c = state.chunk(2, -1)
        i, f, g, o = (gx + self.hidden_proj(h)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, torch.cat([h, c], -1)
