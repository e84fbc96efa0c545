"""The compiled path (``compile=on``): the rollout's per-step policy function and the PPO loss
as ``torch.compile`` graphs.

What is compiled, and why there:

- :func:`mappo.rollout.policy_step`: every group's actor forward, action sampling, log-probs and
  the recurrent critics' step, once per env step. Sampling noise is drawn eagerly from the run's
  generator just before (:meth:`~mappo.nn.actor_critic.ActorCritic.draw_noise`): a
  ``torch.Generator`` cannot enter a graph, and drawing the same numbers outside gives exactly
  the eager path's actions.
- :func:`mappo.algos.mappo.loss_terms`: a mini-batch's forward pass and losses; autograd then
  runs the compiled backward (for recurrent networks with chunks of at most
  :data:`MAX_COMPILED_CHUNK` steps). Mini-batch selection and the ValueNorm/PopArt update (which
  rescales parameters in place) stay eager, so the compiled function is pure.

Both are compiled with ``fullgraph=True`` (a graph break is an error, not a silent slow path)
and static shapes (each distinct shape compiles once: full mini-batches, and a shorter last one
when the chunks do not divide evenly). Eager stays the reference: the compiled path computes the
same functions in the same order, and a checkpoint written by either loads in the other (the
parameters are the same modules). Compiled graphs are cached on disk by torch (inductor's
cache), so a second run of the same preset compiles in seconds.

Not yet done: replaying the graphs as CUDA graphs (``mode="reduce-overhead"``). Their outputs
live in a memory pool that the next replay overwrites, and the collector keeps the recurrent
states it returns across steps and updates; that needs copies or step marks, and a GPU to test
on.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from mappo.config import ConfigError

SETTINGS = ("off", "on", "auto")
"""The values of ``compile`` (repeated in :mod:`mappo.config`, which does not import torch)."""

MAX_COMPILED_CHUNK = 32
"""Recurrent chunks longer than this keep the loss eager: the compiled graph unrolls the
recurrence step by step, and a 128-step chunk (JaxMARL's settings) took about 7 minutes to
compile on the 2-core CPU for a 1.4x faster update. The eager loss runs such chunks through
torch's fused recurrent kernel between resets instead (:class:`~mappo.nn.layers.RecurrentCore`).
"""


def wanted(setting: str, device: torch.device) -> bool:
    """Whether ``compile=setting`` compiles on ``device``. ``auto`` compiles on CUDA only, where
    launching many tiny kernels is the known cost (not yet measured here); on the CPU the
    compiled path measured 1.2-1.6x faster on three of four particle-world presets, which does
    not repay a cold compile of 15-60 s on short runs (BENCHMARKS.md)."""
    if setting not in SETTINGS:
        raise ConfigError(f"compile={setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "auto":
        return device.type == "cuda"
    return setting == "on"


def compile_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled as one static-shape graph (``fullgraph``).

    Each call compiles a fresh copy of ``fn`` (a new code object): torch keeps its compiled
    graphs per code object and refuses after a few recompilations, which would otherwise come
    from the networks of every run started in one process (tests, sweeps, notebooks).
    """
    fresh = types.FunctionType(
        fn.__code__.replace(),
        fn.__globals__,
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__
    return torch.compile(fresh, fullgraph=True, dynamic=False)


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling so far (dynamo and inductor, forward and
    backward graphs); the difference over a run is that run's compile time."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
