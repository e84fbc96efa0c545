"""Hanabi's step and views in C for games on a CPU (``hanabi_native.c``).

At thousands of games a torch step of Hanabi is hundreds of small tensor operations, and at the
tens of games a CPU training run steps, each costs more in dispatch than in arithmetic. The C
file does the same work one game after another on the same state tensors (the data pointers of
:attr:`~mappo.envs.hanabi.game.HanabiGames.state`): same rules, same observation, same states
for any move, checked against the torch code in the tests.

The file is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into a
shared library cached under ``$MAPPO_CACHE_DIR`` (default ``~/.cache/mappo``), named by a hash
of the source and the flags, and loaded with ``ctypes``; nothing outside this package's own
source is compiled or loaded. Each variant gets a library of its own with its sizes compiled in
as constants (about 2 s of compiling, once per machine and variant; its views 1.2-1.3x faster
than with the sizes read at run time, BENCHMARKS.md). Where torch's OpenMP runtime is GNU's
libgomp (its Linux wheels), the library is built with ``-fopenmp`` and links to that same
runtime, so a call's games are split between torch's own threads; elsewhere between a pool of
threads of ours. Where no compiler works, :func:`library` returns ``None`` with the reason in
:func:`unavailable_reason` and the games step in torch.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from mappo import native_build
from mappo.native_build import cache_dir  # noqa: F401  (where the libraries are kept)

FIELDS = (
    "deck",
    "dealt",
    "hands",
    "hand_count",
    "color_ok",
    "rank_ok",
    "color_hint",
    "rank_hint",
    "fireworks",
    "info",
    "life",
    "discards",
    "player",
    "turns_left",
    "over",
    "last_kind",
    "last_player",
    "last_target",
    "last_color",
    "last_rank",
    "last_revealed",
    "last_slot",
    "last_card",
    "last_scored",
    "last_token",
)
"""The state tensors in the order the C code's field enum lists them."""

MAX_PLAYERS, MAX_HAND, MAX_VIEW, MAX_MOVES, MAX_DECK = 5, 8, 2048, 64, 128
"""The C code's fixed buffers: rules beyond them step in torch."""

_SOURCE = Path(__file__).with_name("hanabi_native.c")
_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
_LIBCALL = ("-mstringop-strategy=libcall",)
"""Tried first on x86-64: GCC expands the views' copies and clears of fixed sizes (hundreds of
bytes) inline as ``rep movs``/``rep stos``, slow to start on some x86 CPUs; as calls, the C
library's ``memcpy``/``memset`` (chosen for the CPU at load time) do them. A whole env step at
4,096 2-player games 1.08-1.12x faster on an AMD EPYC (BENCHMARKS.md). Compilers without the
option (clang) get the build without it."""
_lock = threading.Lock()
_libraries: dict[tuple[int, ...], ctypes.CDLL | None] = {}
_reason: str | None = None
_pool: ThreadPoolExecutor | None = None
_forked = False  # this process is a forked child: no OpenMP team to hand rows to

# hanabi_run's number of each function and its arguments as hanabi_run's (a, b, p0, ..., p4)
_RUN = {
    "hanabi_step": (0, lambda moves, rewards: (0, 0, moves, rewards, None, None, None)),
    "hanabi_legal": (1, lambda out: (0, 0, out, None, None, None, None)),
    "hanabi_observe": (2, lambda belief, out, width: (belief, width, out, None, None, None, None)),
    "hanabi_views": (
        3,
        lambda paper, byte, obs, state, mask, alive: (paper, byte, obs, state, mask, alive, None),
    ),
    "hanabi_deal": (4, lambda decks: (0, 0, decks, None, None, None, None)),
    "hanabi_env_step": (
        5,
        lambda batch, actions, length, counts, rewards, stats: (
            batch,
            0,
            actions,
            length,
            counts,
            rewards,
            stats,
        ),
    ),
    "hanabi_shuffle": (6, lambda deal, keys, decks: (deal, 0, keys, decks, None, None, None)),
}

MIN_GAMES_PER_THREAD = 256
"""Below this many games per thread a call stays on one thread (the hand-off costs more)."""
MIN_GAMES_PER_OPENMP_THREAD = 32
"""The same for torch's OpenMP threads, which take work in microseconds (256 games stepped
1.05-1.27x faster split in two than on one thread; 64 games the same either way)."""


class Rules(ctypes.Structure):
    """The C code's ``Rules``: the variant's sizes."""

    _fields_ = [
        (name, ctypes.c_int64) for name in ("P", "C", "R", "H", "D", "MI", "ML", "obs", "M")
    ] + [
        ("color_of", ctypes.c_int64 * 32),
        ("rank_of", ctypes.c_int64 * 32),
    ]


def _sizes(rules) -> tuple[int, ...]:
    """A variant's sizes in the order of the C code's ``Rules`` (and of :class:`Rules`)."""
    return (
        rules.players,
        rules.colors,
        rules.ranks,
        rules.hand,
        rules.deck_size,
        rules.max_information_tokens,
        rules.max_life_tokens,
        rules.observation_size,
        rules.num_moves,
    )


def _torch_uses_libgomp() -> bool:
    """Whether torch's OpenMP runtime is GNU's ``libgomp`` (:mod:`mappo.native_build`)."""
    return native_build.torch_uses_libgomp()


def _compile(sizes: tuple[int, ...], rebuild: bool = False, openmp: bool = False) -> Path:
    """The path of the library for a variant of these ``sizes`` (:func:`_sizes`, compiled in as
    constants; with ``openmp``, built with ``-fopenmp``), compiling it first if no cached copy
    exists (or always, with ``rebuild``). Raises ``RuntimeError`` naming what failed."""
    return native_build.build(_SOURCE, "hanabi", _flags(sizes, openmp), rebuild)


def _flags(sizes: tuple[int, ...], openmp: bool) -> tuple[str, ...]:
    """The compiler flags for a variant of these ``sizes`` (compiled in as constants)."""
    names = [name for name, _ in Rules._fields_[: len(sizes)]]
    defines = [f"-DHANABI_{name}={value}" for name, value in zip(names, sizes, strict=True)]
    return (*_FLAGS, *(["-fopenmp"] if openmp else []), *defines)


def library(rules) -> ctypes.CDLL | None:
    """The loaded C library for the variant ``rules`` (a
    :class:`~mappo.envs.hanabi.game.HanabiRules`: its sizes are compiled in), or ``None`` where
    it cannot be built (see :func:`unavailable_reason`). Built and loaded once per process and
    variant."""
    global _reason
    key = _sizes(rules)
    with _lock:
        if key not in _libraries:
            # with torch's libgomp loaded, a build that shares its threads; else (or where the
            # compiler has no OpenMP) one that splits rows between threads of our own
            openmp = [True, False] if _torch_uses_libgomp() else [False]
            extras = [_LIBCALL, ()] if platform.machine().lower() in ("x86_64", "amd64") else [()]
            candidates = [(_flags(key, o) + extra, "") for o in openmp for extra in extras]
            lib, why = native_build.load_first(_SOURCE, "hanabi", candidates)
            if lib is None:
                _reason = why
            else:
                p, i64 = ctypes.c_void_p, ctypes.c_int64
                common = [ctypes.POINTER(Rules), p, p, i64, i64]
                lib.hanabi_step.argtypes = [*common, p, p]
                lib.hanabi_legal.argtypes = [*common, p]
                lib.hanabi_observe.argtypes = [*common, ctypes.c_int, p, i64]
                lib.hanabi_views.argtypes = [*common, ctypes.c_int, ctypes.c_int, p, p, p, p]
                lib.hanabi_deal.argtypes = [*common, p]
                lib.hanabi_env_step.argtypes = [*common, i64, p, p, p, p, p]
                lib.hanabi_shuffle.argtypes = [*common, ctypes.c_int, p, p]
                # fn, threads, rules, state, ids, rows, a, b, p0..p4
                c_int = ctypes.c_int
                lib.hanabi_run.argtypes = [c_int, c_int, *common[:3], i64, i64, i64, *[p] * 5]
                for fn in _RUN:
                    getattr(lib, fn).restype = None
                lib.hanabi_run.restype = None
                lib.hanabi_openmp.argtypes = []
                lib.hanabi_openmp.restype = ctypes.c_int
            _libraries[key] = lib
        return _libraries[key]


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` if it has not or it loaded)."""
    return _reason


def fits(rules) -> bool:
    """Whether the C code's fixed buffers hold a variant's views and moves."""
    view = rules.observation_size + rules.players + rules.hand * rules.colors * rules.ranks
    return (
        rules.players <= MAX_PLAYERS
        and rules.colors * rules.ranks <= 25
        and rules.ranks <= 8
        and rules.hand <= MAX_HAND
        and view <= MAX_VIEW
        and rules.num_moves <= MAX_MOVES
        and rules.deck_size <= MAX_DECK
    )


class NativeGames:
    """The C functions bound to one :class:`~mappo.envs.hanabi.game.HanabiGames`' rules; each
    call takes the games' state dict (its tensors contiguous, of the dtypes ``reset`` makes)."""

    def __init__(self, lib: ctypes.CDLL, rules) -> None:
        self.lib = lib
        self._hanabi_rules = rules
        cards = range(rules.colors * rules.ranks)
        color_of = (ctypes.c_int64 * 32)(*[card // rules.ranks for card in cards])
        rank_of = (ctypes.c_int64 * 32)(*[card % rules.ranks for card in cards])
        self.rules = Rules(*_sizes(rules), color_of, rank_of)
        self._rules_ref = ctypes.byref(self.rules)
        self._openmp = bool(lib.hanabi_openmp())
        self._tensors: list[Tensor] = []
        self._pointers = (ctypes.c_void_p * len(FIELDS))()

    def __reduce__(self):
        # a copy (an env's deepcopy, a pickle) binds the rules again; never the pointers
        return (_rebind, (self._hanabi_rules,))

    def fresh(self) -> NativeGames:
        """Another binding of the same rules with its own pointer cache (for a selection of
        games, which may be stepped beside the whole batch)."""
        return NativeGames(self.lib, self._hanabi_rules)

    def pointers(self, state: dict[str, Tensor]) -> ctypes.Array:
        """The state's data pointers in :data:`FIELDS` order (contiguous copies put back into
        ``state`` where a tensor is not). Read again only when ``state`` holds other tensor
        objects than at the last call (a step replaces none; a reset or a selection does)."""
        tensors = [state[name] for name in FIELDS]
        # the same objects with the same storage (``set_`` or ``share_memory_`` keep the object
        # and move its data)
        if len(tensors) != len(self._tensors) or any(
            a is not b or a.data_ptr() != p
            for a, b, p in zip(tensors, self._tensors, self._pointers, strict=True)
        ):
            for name in FIELDS:
                if not state[name].is_contiguous():
                    state[name] = state[name].contiguous()
            self._tensors = [state[name] for name in FIELDS]
            self._pointers[:] = [t.data_ptr() for t in self._tensors]
        return self._pointers

    def run(
        self, fn: str, state: dict[str, Tensor] | None, rows: int, ids: Tensor | None, *args
    ) -> None:
        """Call C function ``fn`` on rows ``0 .. rows-1`` (games ``ids[row]``, or game ``row``),
        split between torch's threads when there are enough rows. ``state`` is ``None`` for a
        function that reads no game (shuffling decks alone)."""
        ptrs = self.pointers(state) if state is not None else None
        ids_ptr = ids.data_ptr() if ids is not None else None
        if self._openmp:  # torch's OpenMP threads take the rows (the C code splits them)
            number, place = _RUN[fn]
            threads = min(torch.get_num_threads(), rows // MIN_GAMES_PER_OPENMP_THREAD)
            threads = 1 if _forked else max(threads, 1)
            self.lib.hanabi_run(
                number, threads, self._rules_ref, ptrs, ids_ptr, rows, *place(*args)
            )
            return
        call = getattr(self.lib, fn)
        threads = min(torch.get_num_threads(), rows // MIN_GAMES_PER_THREAD)
        if threads <= 1:
            call(self._rules_ref, ptrs, ids_ptr, 0, rows, *args)
            return
        bounds = [rows * k // threads for k in range(threads + 1)]
        pool = _thread_pool(threads - 1)
        jobs = [
            pool.submit(call, self._rules_ref, ptrs, ids_ptr, lo, hi, *args)
            for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)
        ]
        try:  # this thread takes the first share (one hand-off fewer)
            call(self._rules_ref, ptrs, ids_ptr, 0, bounds[1], *args)
        finally:
            for job in jobs:
                job.result()


def _rebind(rules) -> NativeGames:
    lib = library(rules)
    if lib is None:
        raise RuntimeError(f"the native Hanabi library cannot be built: {_reason}")
    return NativeGames(lib, rules)


def _forget_pool() -> None:
    # a forked child inherits the pool object but not its threads: it would wait forever; and
    # the parent's OpenMP team is not its own either
    global _pool, _lock, _forked
    _pool = None
    _lock = threading.Lock()  # another thread may have held it at the fork
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < threads:
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mappo-hanabi")
        return _pool
