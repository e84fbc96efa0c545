"""Environment throughput: env steps per second of batched envs, and of the PettingZoo MPE.

One env step is every agent of one env acting once, so a batched step of ``E`` envs counts ``E``
env steps. Actions are random and valid, and the random numbers are drawn before the clock starts
(a ring of pre-generated batches on the device), so random number generation is not timed: envs
without action masks cycle through pre-drawn actions; envs with masks cycle through pre-drawn
uniform noise and pick, per head, the allowed action with the largest noise (one on-device
``argmax(noise * mask)`` per head, which is timed, since it depends on the step's mask). The
per-step action checks are off (``validate_actions = False``), as in the trainer's hot loop;
auto-resets are included.

The reference row steps ``mpe2.simple_spread_v3.parallel_env()`` (PettingZoo MPE, default
settings) one env at a time in a Python loop with pre-drawn random actions, resetting when the
episode ends.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mappo.compiled import compile_fn
from mappo.envs import BatchedEnv, EnvStep, make
from mappo.envs.rendering import masked_choice, random_box

ACTION_RING = 32
"""Pre-generated action batches per env for unmasked envs (cycled through)."""


def _ring_of_actions(env: BatchedEnv, gen: torch.Generator) -> list[dict[str, Tensor]]:
    """``ACTION_RING`` random valid action batches ``[E, n, k]`` per group, on the device."""
    ring: list[dict[str, Tensor]] = []
    for _ in range(ACTION_RING):
        batch = {}
        for name, group in env.spec.groups.items():
            shape = (env.num_envs, group.num_agents)
            if group.action.continuous:
                batch[name] = random_box(group.action, shape, env.device, gen)
                continue
            heads = [
                torch.randint(0, size, shape, device=env.device, generator=gen)
                for size in group.action.nvec
            ]
            batch[name] = torch.stack(heads, dim=-1)
        ring.append(batch)
    return ring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ring_of_noise(env: BatchedEnv, gen: torch.Generator) -> list[dict[str, Tensor]]:
    """``ACTION_RING`` batches of uniform noise ``[E, n, sum(nvec)]`` per group, on the device,
    for drawing masked actions with :func:`masked_choice`."""
    return [
        {
            name: torch.rand(
                env.num_envs,
                group.num_agents,
                sum(group.action.nvec),
                device=env.device,
                generator=gen,
            )
            for name, group in env.spec.groups.items()
        }
        for _ in range(ACTION_RING)
    ]


def _masked_actions(env: BatchedEnv, step: EnvStep, noise: dict[str, Tensor]) -> dict[str, Tensor]:
    """Uniformly random allowed actions ``[E, n, k]`` per group from pre-drawn ``noise``."""
    return {
        name: masked_choice(noise[name], step.action_mask[name], group.action.nvec)
        for name, group in env.spec.groups.items()
    }


@torch.no_grad()
def bench_batched(
    name: str, num_envs: int, seconds: float, device: str = "cpu", **env_kwargs: Any
) -> float:
    """Env steps per second of the batched env ``name`` with ``num_envs`` envs (``env_kwargs``
    passed on to it)."""
    env = make(name, num_envs=num_envs, device=device, seed=0, **env_kwargs)
    env.validate_actions = False
    gen = torch.Generator(device=env.device)
    gen.manual_seed(0)
    masked = any(g.has_action_mask for g in env.spec.groups.values())
    ring = _ring_of_noise(env, gen) if masked else _ring_of_actions(env, gen)

    def act(step: EnvStep, i: int) -> dict[str, Tensor]:
        return _masked_actions(env, step, ring[i]) if masked else ring[i]

    step = env.reset(seed=0)
    # Warm-up: first calls allocate and (on CUDA) initialise kernels.
    for i in range(10):
        step = env.step(act(step, i % ACTION_RING))
    _sync(env.device)
    count = 0
    start = time.perf_counter()
    while True:
        for i in range(ACTION_RING):
            step = env.step(act(step, i))
            count += 1
        _sync(env.device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    env.close()
    return num_envs * count / elapsed


COMPILED_BLOCK = 8
"""Env steps per compiled call in :func:`bench_compiled` (as the trainer's rollout blocks)."""


class CompiledStepper:
    """Steps an env ``COMPILED_BLOCK`` steps per call of one compiled graph
    (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_steps`: the particle world's, episode ends
    included, their new episodes drawn when the steps are claimed), and one step eagerly where
    the env hands out no traced steps. A block takes ``actions[0..K-1]`` in turn; an eager step
    ``actions[count % K]``, where ``count`` is the number of steps taken before it. ``log``
    records ``(count, steps)`` per call, so that an eager copy of the env can be driven through
    the same actions."""

    def __init__(self, env: BatchedEnv, actions: list[dict[str, Tensor]]) -> None:
        from mappo.learners.ppo import traces

        if not traces(env):
            raise ValueError(f"{env.name}: its step cannot be traced (particle worlds only)")
        self.env, self.actions = env, actions[:COMPILED_BLOCK]

        def block(env_step: Any, actions: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
            # The rewards are returned so that no step is dead code.
            return [env_step(a).reward for a in actions]

        # A fresh code object per stepper (compile_fn): torch would otherwise count every env
        # and size timed in one process as a recompilation of one function, and stop at eight.
        self.fn = compile_fn(block)
        self.count = 0
        self.log: list[tuple[int, int]] = []

    def advance(self) -> int:
        """One block, or one eager step where the env hands out no block; the steps taken."""
        traced = self.env.claim_traced_steps(COMPILED_BLOCK)
        if traced is None:
            self.env.step(self.actions[self.count % len(self.actions)])
            taken = 1
        else:
            self.fn(traced, self.actions)
            taken = COMPILED_BLOCK
        self.log.append((self.count, taken))
        self.count += taken
        return taken

    def replay(self, env: BatchedEnv, since: int = 0) -> None:
        """Step ``env`` eagerly through the actions of every call so far (from call ``since``
        on)."""
        for count, taken in self.log[since:]:
            if taken == 1:
                env.step(self.actions[count % len(self.actions)])
            else:
                for a in self.actions:
                    env.step(a)


@torch.no_grad()
def bench_compiled(
    name: str, num_envs: int, seconds: float, device: str = "cpu"
) -> tuple[float, float]:
    """Env steps per second of the particle world ``name`` with its steps compiled
    (:class:`CompiledStepper`), and the largest difference of its state from an eager copy of
    the env driven through the same actions, compared after every call over the first three and
    a half episodes (the compiled arithmetic is the same up to rounding)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    env = make(name, num_envs=num_envs, device=device, seed=0)
    twin = make(name, num_envs=num_envs, device=device, seed=0)
    for e in (env, twin):
        e.validate_actions = False
        e.reset(seed=0)
    stepper = CompiledStepper(env, _ring_of_actions(env, gen))
    # Compared after every call (a reset redraws every env's state, so a check at the end alone
    # would see only the steps since the last one), ending inside an episode.
    diff, blocks = 0.0, 0
    while stepper.count < 3 * env.episode_length + env.episode_length // 2:
        blocks += stepper.advance() > 1
        stepper.replay(twin, since=len(stepper.log) - 1)
        mine, theirs = env.get_state(), twin.get_state()
        gaps = (float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine)
        diff = max(diff, *gaps)
    twin.close()
    if blocks == 0:  # every step eager: the row would time the eager env under another name
        raise RuntimeError(f"{name}: no steps were compiled (episodes shorter than a block?)")
    _sync(dev)
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(ACTION_RING):
            count += stepper.advance()
        _sync(dev)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    env.close()
    return num_envs * count / elapsed, diff


def bench_pettingzoo_mpe(seconds: float) -> float:
    """Env steps per second of ``mpe2.simple_spread_v3.parallel_env()`` in a Python loop."""
    with warnings.catch_warnings():
        # PettingZoo's notice that it prefers a registry to per-env modules; the per-env
        # module is mpe2's documented entry point.
        warnings.simplefilter("ignore", DeprecationWarning)
        from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env()
    env.reset(seed=0)
    agents = list(env.agents)
    sizes = [int(env.action_space(a).n) for a in agents]
    rng = np.random.default_rng(0)
    table = rng.integers(0, sizes, size=(1024, len(agents)))
    ring = [dict(zip(agents, (int(x) for x in row), strict=True)) for row in table]
    count = 0
    start = time.perf_counter()
    while True:
        for actions in ring:
            _, _, terminations, truncations, _ = env.step(actions)
            count += 1
            if any(terminations.values()) or any(truncations.values()):
                env.reset()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    env.close()
    return count / elapsed


def bench_open_spiel_hanabi(players: int, seconds: float) -> float:
    """Env steps per second of OpenSpiel's ``hanabi`` game (the full game, ``players``) in a
    Python loop: per step the legal moves, a random one of them, the deal that follows, and every
    player's observation tensor (what the batched env computes each step); a new game when one
    ends. Needs ``open_spiel``."""
    import pyspiel

    game = pyspiel.load_game("hanabi", {"players": players})
    rng = np.random.default_rng(0)
    noise = rng.random(4096)
    state, count, k = game.new_initial_state(), 0, 0
    start = time.perf_counter()
    while True:
        for _ in range(256):
            while state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes(), strict=True)
                state.apply_action(outcomes[int(np.searchsorted(np.cumsum(probs), noise[k]))])
                k = (k + 1) % len(noise)
            legal = state.legal_actions()
            state.apply_action(legal[int(noise[k] * len(legal))])
            k = (k + 1) % len(noise)
            while state.is_chance_node():
                outcomes, probs = zip(*state.chance_outcomes(), strict=True)
                state.apply_action(outcomes[int(np.searchsorted(np.cumsum(probs), noise[k]))])
                k = (k + 1) % len(noise)
            for p in range(players):
                state.observation_tensor(p)
            count += 1
            if state.is_terminal():
                state = game.new_initial_state()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return count / elapsed


def run_env_bench(
    env_names: Sequence[str] = ("mpe/simple_spread",),
    num_envs: Sequence[int] = (1, 128, 1024, 4096),
    seconds: float = 2.0,
    device: str = "cpu",
    include_pettingzoo: bool = True,
    num_threads: int | None = 1,
    compiled: bool = False,
    hanabi_backends: Sequence[str] = ("auto",),
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Measure every env of ``env_names`` at every batch size of ``num_envs`` for about
    ``seconds`` each; with ``include_pettingzoo`` add the reference rows: ``{"env": "mpe2",
    "num_envs": 1}`` for the particle envs, and for each Hanabi player count measured
    ``{"env": "open_spiel:hanabi-<P>p", "num_envs": 1}`` (when ``open_spiel`` is installed).

    Returns rows ``{"env", "num_envs", "steps_per_second", "device"}``. ``num_threads`` sets
    torch's intra-op threads for the measurement (restored afterwards; ``None`` keeps the current
    setting). One thread is fastest for the particle envs on a 2-core machine: their tensors are
    small (tens of thousands of floats), so a second thread mostly adds synchronisation, and it
    collapses when other processes share the cores.

    With ``compiled``, each particle world also gets a row ``{"env": "<name> compiled", ...,
    "state_diff"}`` of :func:`bench_compiled` (its steps compiled, eight to a graph).

    ``hanabi_backends``: each Hanabi env is timed on each of these backends
    (:class:`~mappo.envs.hanabi.game.HanabiGames`); with more than one, its rows are named
    ``"<name> (<backend>)"``. ``rows``: a list to append the rows to as they are measured (what
    an interrupted caller still has), returned.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    rows = [] if rows is None else rows
    try:
        for name in env_names:
            variants: list[tuple[str, dict[str, Any]]] = [(name, {})]
            if name.startswith("hanabi/"):
                many = len(hanabi_backends) > 1
                variants = [
                    (f"{name} ({b})" if many else name, {"backend": b}) for b in hanabi_backends
                ]
            for n in num_envs:
                for label, kwargs in variants:
                    sps = bench_batched(name, n, seconds, device, **kwargs)
                    rows.append(
                        {"env": label, "num_envs": n, "steps_per_second": sps, "device": device}
                    )
                if compiled and name.startswith("mpe/"):
                    sps, diff = bench_compiled(name, n, seconds, device)
                    rows.append(
                        {
                            "env": f"{name} compiled",
                            "num_envs": n,
                            "steps_per_second": sps,
                            "device": device,
                            "state_diff": diff,
                        }
                    )
        particles = any(n.startswith(_PARTICLE_PREFIXES) for n in env_names)
        if include_pettingzoo and particles and importlib.util.find_spec("mpe2") is None:
            warnings.warn(
                "the mpe2 reference row is left out: mpe2 is not installed "
                "(`pip install 'mappo[pettingzoo]'`)",
                stacklevel=2,
            )
        elif include_pettingzoo and particles:
            sps = bench_pettingzoo_mpe(seconds)
            rows.append({"env": "mpe2", "num_envs": 1, "steps_per_second": sps, "device": "cpu"})
        hanabi = sorted({n for n in env_names if n.startswith("hanabi/full-")})
        if include_pettingzoo and hanabi and importlib.util.find_spec("pyspiel") is not None:
            for name in hanabi:
                players = int(name.removeprefix("hanabi/full-").removesuffix("p"))
                sps = bench_open_spiel_hanabi(players, seconds)
                rows.append(
                    {
                        "env": f"open_spiel:hanabi-{players}p",
                        "num_envs": 1,
                        "steps_per_second": sps,
                        "device": "cpu",
                    }
                )
    finally:
        torch.set_num_threads(previous)
    return rows


_PARTICLE_PREFIXES = ("mpe/", "pettingzoo:mpe2", "mpe2")
"""Envs compared with mpe2's Spread: the particle world's, ours and mpe2's through the adapter."""


def _reference_of(env: str) -> str | None:
    """The reference row an env's speed is compared with (``None``: none, as for the combat
    simulator or VMAS, which no reference row simulates)."""
    env = env.removesuffix(" compiled").split(" (")[0]
    if env.startswith("hanabi/full-") or env.startswith("open_spiel:hanabi-"):
        return "open_spiel:hanabi-" + env.rsplit("-", 1)[-1]
    return "mpe2" if env.startswith(_PARTICLE_PREFIXES) else None


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`run_env_bench` rows; with reference rows (``mpe2``,
    ``open_spiel:hanabi-<P>p``), each row's speed-up over its reference."""
    refs = {r["env"]: r["steps_per_second"] for r in rows if r["env"] == _reference_of(r["env"])}
    diffs = any("state_diff" in r for r in rows)
    header = ["env", "num_envs", "device", "steps/s"] + (["x reference"] if refs else [])
    header += ["state diff vs eager"] if diffs else []
    table = [header]
    for r in rows:
        line = [r["env"], str(r["num_envs"]), str(r["device"]), f"{r['steps_per_second']:,.0f}"]
        if refs:
            ref = refs.get(_reference_of(r["env"]))
            line.append(f"{r['steps_per_second'] / ref:,.1f}" if ref else "")
        if diffs:
            line.append(f"{r['state_diff']:.1e}" if "state_diff" in r else "")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for k, row in enumerate(table):
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
