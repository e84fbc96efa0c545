"""The compiled path (``compile=on``): the rollout's per-step policy function and the PPO loss
as ``torch.compile`` graphs.

What is compiled, and why there:

- :func:`mappo.rollout.policy_step`: every group's actor forward, action sampling, log-probs and
  the recurrent critics' step, once per env step. Sampling noise is drawn eagerly from the run's
  generator just before (:meth:`~mappo.nn.actor_critic.ActorCritic.draw_noise`): a
  ``torch.Generator`` cannot enter a graph, and drawing the same numbers outside gives exactly
  the eager path's actions.
- :func:`mappo.rollout.fused_step` (CPU; CUDA for feed-forward networks): the policy step, the
  env's step and the episode tracker as one graph, on every step where the env lets its step be
  traced (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_step`: the particle world does on
  every step, time-limit ends included, the new episodes' random numbers drawn when the step is
  claimed). About a hundred small ops per step become one call and a few fused kernels; the
  rollout of JaxMARL's Spread settings took 1.6x less time (BENCHMARKS.md). Other envs run the
  policy graph and the env's eager step.
- :func:`mappo.rollout.fused_steps` (feed-forward networks): :data:`ROLLOUT_BLOCK`
  fused steps as one graph, with what the rollout records of each, wherever the env lets
  that many steps in a row be traced (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_steps`;
  the particle world's, across episode ends too, so a rollout is whole blocks and a few single
  steps, one graph each, whether or not an episode ends in them).
  What remained per step around the fused graph (torch's guards and call wrapper, a dozen
  copies into the rollout buffers) cost as much as the graph itself: the rollout of JaxMARL's
  Spread settings took 1.7x less time. Recurrent networks keep one step per call: their update
  outweighs the rollout, and the block's longer compile (about 37 s for the paper's recurrent
  preset) bought 2-3% there.
- :func:`mappo.rollout.rollout_values` (CPU): the feed-forward critics' values of a whole
  rollout after its last step, one graph per iteration. Eager, its two ``tanh`` layers over
  every step's rows were most of its 5 ms at JaxMARL's Spread settings; compiled, the
  iteration took 1.06-1.09x less time (one process alternating, BENCHMARKS.md), for about 4 s
  of cold compile.
- :func:`mappo.algos.mappo.gradient_step` (feed-forward networks): a mini-batch's whole step,
  the loss and its gradients (:func:`torch.func.grad`), each network's gradient clipping and Adam,
  as one graph that updates the parameters and the optimisers' state in place. On the CPU the eager
  step's few hundred small calls (autograd's engine, zeroing, clipping, two optimisers) cost more
  than the arithmetic of the small networks here; the update of JaxMARL's Spread settings took about
  1.5x less time, for about 13 s more cold compile (BENCHMARKS.md). Mini-batch selection and the
  ValueNorm/PopArt update (which rescales parameters in place) stay eager, before the graph.
- :func:`mappo.algos.mappo.loss_terms` (recurrent networks): a mini-batch's forward
  pass and losses; autograd then runs the compiled backward and ``torch.optim.Adam`` steps
  eagerly (for recurrent networks with chunks of at most :data:`MAX_COMPILED_CHUNK` steps).
  A recurrent loss's arithmetic outweighs the step's overhead: one graph for the whole step
  gained nothing measurable there and took 30 s longer to compile.

All are compiled with ``fullgraph=True`` (a graph break is an error, not a silent slow path)
and static shapes (each distinct shape compiles once: full mini-batches, and a shorter last one
when the chunks do not divide evenly). Eager stays the reference: the compiled path computes the
same arithmetic (the gradient step writes out what autograd, gradient clipping and
``torch.optim.Adam`` do, and is tested against them), and a checkpoint written by either loads
in the other (the parameters and the optimisers' state are the same tensors). Compiled graphs
are cached on disk by torch (inductor's cache), so a second run of the same preset compiles in
seconds.

The graphs the rollout and the feed-forward update call many times an iteration (the policy
and env steps, the rollout block, the critics' values, the gradient step) are called without
torch's per-call guard check once a kind of call has been compiled (:class:`DirectCalls`, with
a key per function naming what changes between its calls: a mini-batch's size, whether a step
has final observations). The guards' walk over the networks and the env cost 270-370 us per
call; at JaxMARL's feed-forward Spread settings iterations ran 1.13x faster without it (one
process alternating, BENCHMARKS.md).

On CUDA the policy step and the recurrent loss are also replayed as CUDA graphs
(``mode="reduce-overhead"``): one launch for a whole graph instead of one per kernel, which is
where a small network's time goes on a GPU. The graphs that mutate state in place (the fused
rollout steps mutate the env's state, the gradient step the parameters and Adam's state) run as
plain compiled code there (torch does not record a graph that mutates its inputs as a CUDA
graph); on an H100 they still ran the feed-forward rollout and update of JaxMARL's Spread
settings 2.7x faster than the policy graph with an eager env step and the loss graph
(BENCHMARKS.md).
A CUDA graph's outputs live in a memory pool that its next replay overwrites, while the collector
keeps recurrent states across steps and autograd keeps a loss until its backward; so every call
starts a new step for torch (``cudagraph_mark_step_begin``) and copies its outputs out of the pool
(a few small copies, against hundreds of launches saved). Equality with eager on a GPU is checked
by running ``tests/test_compiled.py`` with ``MAPPO_TEST_DEVICE=cuda`` (BENCHMARKS.md records the
runs); CI has no GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from mappo import cpu_kernels
from mappo.config import ConfigError

SETTINGS = ("off", "on", "auto")
"""The values of ``compile`` (repeated in :mod:`mappo.config`, which does not import torch)."""

MAX_COMPILED_CHUNK = 32
"""Recurrent chunks longer than this keep the loss eager: the compiled graph unrolls the
recurrence step by step, and a 128-step chunk (JaxMARL's settings) took about 7 minutes to
compile on the 2-core CPU for a 1.4x faster update. The eager loss runs such chunks through
torch's fused recurrent kernel between resets instead (:class:`~mappo.nn.layers.RecurrentCore`).
"""


ROLLOUT_BLOCK = 8
"""Env steps per call of the compiled rollout block (:func:`mappo.rollout.fused_steps`,
feed-forward networks). Per env step of JaxMARL's Spread settings (16 envs, one thread; one
process alternating): 358 us one step per call, 239 us with 4, 210 us with 8, 198 us with 12;
each step in the block adds about 4 s of cold compile. Eight also fits the particle world's
episodes of 25 steps (three blocks between two resets)."""

BLOCK_MIN_ROLLOUT_STEPS = 150_000
"""Rollout blocks are compiled for runs of at least this many steps per env
(``total_env_steps / num_envs``): the block saved 150-230 us per rollout step on the particle
world's Spread (16 and 128 envs) and costs about 30 s of cold compile, which such a run about
repays at this threshold and repays several times over at JaxMARL's settings (a warm inductor
cache compiles it in seconds)."""


CPU_OPTIONS: dict[str, Any] = {"cpp.use_decompose_tanh": True, "cpp.enable_loop_tail_vec": False}
"""Inductor options for the compiled graphs. On the CPU, ``tanh`` is computed as
``2 / (1 + exp(-2x)) - 1`` (inductor's ``cpp.use_decompose_tanh``) instead of the vectorised
library ``tanh``: the Tanh networks' activations (and the GRU's candidate state) are a large
share of an update's elementwise work (one fused ``tanh(x @ W + b)`` kernel was 12% of an
iteration at JaxMARL's feed-forward Spread settings). A fused ``tanh(x + b)`` over 1,536 x 64
floats (2 threads) takes 68 us against 131 us, with an absolute error of at most 1.8e-7 (5.5e-8
for the library function; the relative error grows near 0, where the values are below 1e-6).

The loops' remainders (a row of 18 observations is two vectors of eight floats and two more) are
left scalar (``cpp.enable_loop_tail_vec`` off): inductor otherwise generates a masked vector
variant of every such loop. Without them the cold compile at JaxMARL's feed-forward Spread
settings took 87-97 s against 90-109 s (medians 92 and 105 s, five and three runs on the
2-core CPU), with no measurable change in speed there or in the paper's recurrent preset (one
process alternating the two forms, BENCHMARKS.md).

CUDA kernels are generated by another backend and do not read these options. Options this torch
does not know (``cpp.use_decompose_tanh`` is recent; the project allows torch 2.4) are left
out."""


WRAPPER_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
"""Inductor options added for the CPU graphs called many times an iteration (the rollout's
policy and env steps, the feed-forward gradient step; ``compile_fn(..., cpp_wrapper=True)``):
the generated code that calls a graph's kernels is C++ instead of Python. At JaxMARL's
feed-forward Spread settings each such call had spent about a millisecond in its Python wrapper
(the profiler's self time of ``CompiledFxGraph``: allocating buffers, calling each kernel through
its binding), on graphs of a few milliseconds. One process, with and without these options
alternating (2-core CPU): 1.09x the iterations of that preset, and the rollouts of JaxMARL's
recurrent settings (a graph called 128 times an iteration) and of the paper's rMAPPO 4-9%
faster; cold compile about the same (78 against 86 s and 88 against 80 s with every graph
wrapped, one run each). The recurrent loss keeps
inductor's Python wrapper and the batched kernel builds of :mod:`mappo.cpu_kernels` (one C++ file
for its large backward graph took 31 s of ``g++ -O3`` alone; BENCHMARKS.md)."""


def _known(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the keys this torch's inductor config lacks (older releases)."""
    from torch._inductor import config

    def known(key: str) -> bool:
        node: Any = config
        for part in key.split("."):
            if not hasattr(node, part):
                return False
            node = getattr(node, part)
        return True

    return {k: v for k, v in options.items() if known(k)}


def fuses_env_step(device: torch.device, recurrent: bool) -> bool:
    """Whether the compiled rollout traces the env's step with the policy on ``device``
    (:func:`mappo.rollout.fused_step`, and :func:`mappo.rollout.fused_steps` for long
    feed-forward runs). On the CPU always. On CUDA for feed-forward networks: at JaxMARL's
    Spread settings on an H100 the rollout took 119 ms per iteration against 296 ms with the
    policy step replayed as a CUDA graph and the env's hundred small ops launched eagerly
    (BENCHMARKS.md). Those graphs mutate the env's state in place, so torch replays them without
    CUDA graphs. Recurrent networks on CUDA keep the policy step's CUDA graph (not measured
    fused); other devices (MPS) are not measured and keep the eager env step."""
    return device.type == "cpu" or (device.type == "cuda" and not recurrent)


def compiles_gradient_step(device: torch.device, recurrent: bool) -> bool:
    """Whether the compiled update takes a mini-batch's whole step as one graph
    (:func:`mappo.algos.mappo.gradient_step`) rather than compiling the loss alone: for
    feed-forward networks on the CPU (1.47x faster updates of small mini-batches, for about 13 s
    more cold compile) and on CUDA (37 ms an update at JaxMARL's Spread settings on an H100
    against 64 ms with the loss replayed as a CUDA graph; BENCHMARKS.md). Recurrent losses gained
    nothing measurable on the CPU for 30 s more compile. Other devices are not measured (and
    their Adam, not fused, keeps its step counts on the CPU)."""
    return device.type in ("cpu", "cuda") and not recurrent


AUTO_CPU_STEPS = 1_000_000
"""``compile=auto`` compiles on the CPU for runs of at least this many env steps (and an env
whose step the rollout can trace): there the compiled path trained seven particle-world presets
1.3-1.7x faster than eager (medians; 2 threads), which repays a cold compile of 15-130 s within
one to a few million steps, and a compile from torch's warm on-disk cache (seconds) at once
(BENCHMARKS.md, "Compiled path"); shorter runs stay eager."""


def wanted(setting: str, device: torch.device, cpu_pays: bool = False) -> bool:
    """Whether ``compile=setting`` compiles on ``device``. ``auto`` compiles on CUDA, where
    launching many tiny kernels is the cost (on one H200 the GPU Spread preset's updates ran
    5x faster compiled with CUDA graphs), and on the CPU where the caller says compiling pays
    (``cpu_pays``: a long run of an env whose step is traced with the policy, see
    :data:`AUTO_CPU_STEPS`)."""
    if setting not in SETTINGS:
        raise ConfigError(f"compile={setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "auto":
        return device.type == "cuda" or cpu_pays
    return setting == "on"


def compile_fn(
    fn: Callable[..., Any],
    cuda_graphs: bool = False,
    fallback: bool = False,
    eager: Callable[..., Any] | None = None,
    mutates: bool = False,
    cpp_wrapper: bool = False,
    direct: Callable[..., Hashable] | None = None,
) -> Callable[..., Any]:
    """``fn`` compiled as one static-shape graph (``fullgraph``), replayed as a CUDA graph when
    ``cuda_graphs`` (for functions whose tensors live on a CUDA device). With ``fallback``
    (``compile=auto``), a call that fails where the eager function succeeds (no C++ compiler, an
    operation torch cannot compile) warns once and runs the eager function from then on:
    ``eager``, a function of the same arguments and results, or ``fn`` itself. ``mutates``:
    ``fn`` updates its inputs in place (an env's state, parameters and Adam's moments), so only
    a failure to compile falls back; a failure while the graph runs may have updated part of
    them, and running ``fn`` again would apply the step twice, so it is raised.
    ``cpp_wrapper``: the graph's calls of its kernels in C++ (:data:`WRAPPER_OPTIONS`), for
    graphs on the CPU that run many times an iteration; not with ``cuda_graphs``.
    ``direct``: a function of ``fn``'s arguments that tells its kinds of call apart; once
    compiled for a kind, the graph is called without torch's per-call guard check
    (:class:`DirectCalls`); not with ``cuda_graphs``.

    Each call compiles a fresh copy of ``fn`` (a new code object): torch keeps its compiled
    graphs per code object and refuses after a few recompilations, which would otherwise come
    from the networks of every run started in one process (tests, sweeps, notebooks).

    With ``cuda_graphs``, each call starts a new step of torch's CUDA-graph trees, which lets
    the next replay reuse the memory of everything the previous one computed. That is safe in
    the order the PPO update runs (one loss, its backward, the clip and the optimiser step, with
    gradients set to None before the next loss) and in the rollout (no autograd), but not for a
    backward that runs after another compiled call, nor for gradients accumulated across calls.
    """
    cpu_kernels.install()
    fresh = types.FunctionType(
        fn.__code__.replace(),
        fn.__globals__,
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__
    if not cuda_graphs:
        options = {**CPU_OPTIONS, **(WRAPPER_OPTIONS if cpp_wrapper else {})}
        compiled = torch.compile(fresh, fullgraph=True, dynamic=False, options=_known(options))
        if direct is not None:
            compiled = DirectCalls(compiled, fresh, direct)
    else:
        graph = torch.compile(fresh, fullgraph=True, dynamic=False, mode="reduce-overhead")

        def compiled(*args: Any, **kwargs: Any) -> Any:
            # A new step: outputs of earlier replays may be overwritten from here on, which is
            # safe because each call below hands out copies, never the pool's own tensors.
            torch.compiler.cudagraph_mark_step_begin()
            return _copy_out(graph(*args, **kwargs))

    return _with_fallback(compiled, eager or fn, fn.__name__, mutates) if fallback else compiled


GUARD_CHECK_EVERY = 64
"""How often a :class:`DirectCalls` function checks torch's guards on a kind of call it has
already checked: on every ``GUARD_CHECK_EVERY``-th call. The environment variable
``MAPPO_GUARD_CHECK_EVERY`` overrides it (1: on every call, where a failed check is an error;
the tests run so)."""


def guard_check_every() -> int:
    """:data:`GUARD_CHECK_EVERY`, or ``$MAPPO_GUARD_CHECK_EVERY`` where set; a value that is not
    a positive whole number is a :class:`~mappo.config.ConfigError`."""
    raw = os.environ.get("MAPPO_GUARD_CHECK_EVERY")
    if raw is None:
        return GUARD_CHECK_EVERY
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every < 1:
        raise ConfigError(
            f"MAPPO_GUARD_CHECK_EVERY={raw!r} is not a positive whole number (unset it for "
            f"every {GUARD_CHECK_EVERY}th call, or 1 to check torch's guards on every call)"
        )
    return every


MAX_CALL_KINDS = 64
"""Kinds of call a :class:`DirectCalls` function remembers before it forgets them all: a bound
on its memory whatever its key function returns."""


class GuardCheckFailed(RuntimeError):
    """A :class:`DirectCalls` function's key missed a change that torch's guards caught (raised
    where every call is checked, as in the tests; never taken for a compile failure)."""


class DirectCalls:
    """A compiled function whose graph, once torch has compiled it for a kind of call, is called
    without torch's per-call guard check.

    Before each call of a compiled function torch checks its guards: that the arguments still
    look as they did when the graph was traced (every tensor's shape and strides, the modules'
    structure and hooks, the Python values the trace read, such as an env's sizes and a flag).
    For the rollout block and the gradient step at JaxMARL's feed-forward Spread settings the
    check walks about 500 guards, which took 270-370 us per call in the training loop (11-14% of
    an iteration; BENCHMARKS.md), where the objects it reads have left the caches. Within one
    trainer nearly all of that is fixed from the first call on: the networks, the env and the
    hyperparameters do not change, and the tensors passed in keep their shapes.

    So the caller names what does change, as a function ``key`` of the call's arguments (a
    mini-batch's size, whether a step has final observations; a few microseconds, where walking
    the arguments' tensors in Python cost a third of the guards). A key seen for the first time
    goes through torch's compiled function, which checks the guards and compiles a new graph if
    none fits; the graph that served it is then called directly for that key: the transformed
    function that torch's cache entry holds, which moves the inputs into the graph and replays
    its side effects, without the eval-frame hook and the guards. Whatever the key leaves out
    must stay as it was for the function's life, and between checks nothing would notice if it
    did not: a changed constant or dtype runs the old graph silently (inductor's generated code
    checks the sizes and strides of the non-empty tensors its kernels read, nothing else). So
    the guards are still checked on the first direct call of each kind and on every
    :data:`GUARD_CHECK_EVERY`-th call of it after that; should they fail, a warning names the
    guard and the function goes back to torch's guarded calls for the rest of the run. The
    tests check before every call and fail on such a miss (:class:`GuardCheckFailed`).

    Torch keeps its cache entries through ``torch._C._dynamo.eval_frame``; where this torch
    does not expose them with their code and guards, the calls stay guarded."""

    def __init__(
        self, compiled: Callable[..., Any], fn: types.FunctionType, key: Callable[..., Hashable]
    ) -> None:
        self.compiled = compiled
        self.fn = fn
        self.key = key
        self.signature = inspect.signature(fn)
        # key -> [the direct call, torch's guard manager for it, its direct calls so far]
        self.kinds: dict[Hashable, list[Any]] = {}
        self.check_every = guard_check_every()
        self.guarded = not _exposes_cache_entries()

    @property
    def calls(self) -> int:
        """Direct calls made so far (of the kinds still remembered)."""
        return sum(kind[2] for kind in self.kinds.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.guarded:
            return self.compiled(*args, **kwargs)
        key = (torch.is_grad_enabled(), self.key(*args, **kwargs))
        kind = self.kinds.get(key)
        if kind is None:
            return self._first(key, args, kwargs)
        call, guards, count = kind
        kind[2] = count + 1
        if count % self.check_every:
            return call(*args, **kwargs)
        f_locals = self._locals(args, kwargs)
        if guards.check(f_locals):
            return call(*args, **kwargs)
        failed = guards.check_verbose(f_locals).verbose_code_parts
        message = (
            f"compiled {self.fn.__name__}: torch's guard {failed} failed for a kind of call "
            "that had passed it (the call key misses what changed)"
        )
        if self.check_every == 1:
            raise GuardCheckFailed(message)
        warnings.warn(
            f"{message}; its calls are guarded from here on (please report this)",
            RuntimeWarning,
            stacklevel=2,
        )
        self.guarded = True
        return self.compiled(*args, **kwargs)

    def _first(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a new kind: through torch's guarded call, remembering the graph that served
        it. The guards are checked before the call, as torch checks them: a graph that updates
        its inputs in place changes what they read."""
        f_locals = self._locals(args, kwargs)
        entries = _cache_entries(self.fn)
        for entry in entries:
            if entry.guard_manager.check(f_locals):
                self._remember(key, entry)
                return self.kinds[key][0](*args, **kwargs)
        seen = {id(entry.code) for entry in entries}
        out = self.compiled(*args, **kwargs)
        new = [e for e in _cache_entries(self.fn) if id(e.code) not in seen]
        # One new entry: the graph compiled for this call. None (torch stopped recompiling, or
        # the call fell back to eager code): the next call of this kind goes through torch again.
        if len(new) == 1:
            self._remember(key, new[0])
        return out

    def _remember(self, key: Hashable, entry: Any) -> None:
        """Call ``entry``'s transformed function directly for calls of kind ``key``; its first
        direct call checks the guards."""
        if len(self.kinds) >= MAX_CALL_KINDS:
            self.kinds.clear()
        fn = self.fn
        call = types.FunctionType(
            entry.code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        call.__kwdefaults__ = fn.__kwdefaults__
        self.kinds[key] = [call, entry.guard_manager, 0]

    def _locals(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The frame's locals on entry that torch's guards read: the bound arguments with their
        defaults, and the closure's cells."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)
        if self.fn.__closure__:
            names = self.fn.__code__.co_freevars
            f_locals.update(
                (n, c.cell_contents) for n, c in zip(names, self.fn.__closure__, strict=True)
            )
        return f_locals


def _exposes_cache_entries() -> bool:
    """Whether this torch hands out a function's compiled variants with their transformed code
    and guards (torch 2.13 does; the project allows older ones)."""
    frame = torch._C._dynamo.eval_frame
    entry = getattr(frame, "_CacheEntry", None)
    return (
        hasattr(frame, "_debug_get_cache_entry_list")
        and entry is not None
        and hasattr(entry, "code")
        and hasattr(entry, "guard_manager")
    )


def _cache_entries(fn: types.FunctionType) -> list[Any]:
    """Torch's compiled variants of ``fn`` (its cache entries, most recent first)."""
    return list(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


COMPILER_HINT = (
    "install g++ or clang++ (on macOS `xcode-select --install`, and `brew install libomp` for "
    "the OpenMP that Apple's clang lacks)"
)

_compiler_broken: str | None = None
"""Why torch could not build C++ code in this process, once a ``compile=auto`` function found
it: every other such function then runs eagerly at once, without a warning of its own and
without spending a compile on the same failure."""


_TOOLCHAIN = re.compile(
    r"-fopenmp|omp\.h|unsupported option|unrecognized command.line option|command not found|"
    r"cannot find -l|cannot find '?ld|fatal error: [^:\n]*\.h: No such file"
)
"""What a compiler says where the toolchain itself fails (no OpenMP for Apple's clang, a
missing header or library), not the code: a build of inductor's own code that the compiler
rejects is torch's bug, and compiling may still work for the other functions."""


def compiler_failure(err: BaseException) -> str | None:
    """Why torch could not build compiled code here, where ``err`` (or an error it wraps, as
    torch wraps the backend's) is a missing or unusable compiler: no working C++ compiler for
    inductor's CPU code, one that cannot build it (Apple's clang without OpenMP), or no C
    compiler for Triton's GPU launchers; else ``None``. One line."""
    e: BaseException | None = err
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        kind = type(e).__name__
        if kind == "InvalidCxxCompiler":
            return f"no working C++ compiler was found ({_first_line(e)})"
        if kind == "CppCompileError":
            output = str(getattr(e, "output", "") or "")
            said = [line.strip() for line in output.splitlines() if "error" in line.lower()]
            if _TOOLCHAIN.search(output):
                return f"the C++ compiler failed: {(said or ['no message'])[0][:200]}"
        if "Failed to find C compiler" in str(e):  # Triton's, building a GPU kernel's launcher
            return "no C compiler was found for Triton (set $CC to one)"
        e = getattr(e, "inner_exception", None) or e.__cause__
    return None


def _with_fallback(
    compiled: Callable[..., Any], fn: Callable[..., Any], name: str, mutates: bool = False
) -> Callable[..., Any]:
    """``compiled``, or ``fn`` once ``compiled`` (of the function called ``name``) has failed
    on arguments that ``fn`` accepts.

    Compilation happens inside the first call with new shapes and fails before the graph
    runs, so the arguments are untouched and ``fn`` can take the call over. An error that
    ``fn`` raises too is the caller's, and is raised as ``fn`` raises it. Where the loss alone
    is compiled (recurrent networks), its backward graph is compiled later, in
    ``backward()`` outside this call; a failure there (with the forward compiled) is not
    caught. A missing C++ compiler fails the forward first.

    With ``mutates``, only torch's compile errors (``TorchDynamoException``: tracing, lowering,
    the C++ or Triton compiler) fall back; any other error comes from running the graph (a
    kernel launch, memory) after it may have updated its inputs, and is raised."""
    use_eager = False

    def call(*args: Any, **kwargs: Any) -> Any:
        global _compiler_broken
        nonlocal use_eager
        if use_eager or _compiler_broken is not None:
            return fn(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except GuardCheckFailed:
            raise  # not a compile failure: the caller's key is wrong
        except Exception as err:
            broken = compiler_failure(err)
            if broken is not None:  # every compiled function would fail the same way
                out = fn(*args, **kwargs)
                _compiler_broken = broken
                warnings.warn(
                    f"compile=auto: torch cannot build its compiled code here: {broken}; the "
                    f"run trains eagerly ({COMPILER_HINT} to compile; compile=off skips "
                    "compiling)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return out
            if mutates and not isinstance(err, torch._dynamo.exc.TorchDynamoException):
                raise RuntimeError(
                    f"compile=auto: the compiled {name} failed while running "
                    f"({type(err).__name__}: {_first_line(err)}); it updates its inputs in "
                    "place, so it is not run again eagerly (compile=off trains without "
                    "compiling)"
                ) from err
            out = fn(*args, **kwargs)
            use_eager = True
            warnings.warn(
                f"compile=auto: compiling {name} failed ({type(err).__name__}: "
                f"{_first_line(err)}); "
                "it runs eagerly from here on (compile=off skips compiling, compile=on makes "
                "this an error)",
                RuntimeWarning,
                stacklevel=2,
            )
            return out

    return call


def _first_line(err: Exception) -> str:
    """The first line of ``err``'s message (at most 200 characters), or its type's name."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _copy_out(x: Any) -> Any:
    """``x`` with every tensor in it copied out of the CUDA-graph memory pool, through tuples,
    lists, dicts and dataclasses (differentiable: a copy's gradient flows back into the replayed
    graph's backward); anything else unchanged."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _copy_out(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [_copy_out(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(
            x, **{f.name: _copy_out(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        )
    return x


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling so far (dynamo and inductor, forward and
    backward graphs); the difference over a run is that run's compile time."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
