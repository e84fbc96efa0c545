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

import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

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
def bench_batched(name: str, num_envs: int, seconds: float, device: str = "cpu") -> float:
    """Env steps per second of the batched env ``name`` with ``num_envs`` envs."""
    env = make(name, num_envs=num_envs, device=device, seed=0)
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


def run_env_bench(
    env_names: Sequence[str] = ("mpe/simple_spread",),
    num_envs: Sequence[int] = (1, 128, 1024, 4096),
    seconds: float = 2.0,
    device: str = "cpu",
    include_pettingzoo: bool = True,
    num_threads: int | None = 1,
) -> list[dict[str, Any]]:
    """Measure every env of ``env_names`` at every batch size of ``num_envs`` for about
    ``seconds`` each; with ``include_pettingzoo`` add the row ``{"env": "mpe2", "num_envs": 1}``.

    Returns rows ``{"env", "num_envs", "steps_per_second", "device"}``. ``num_threads`` sets
    torch's intra-op threads for the measurement (restored afterwards; ``None`` keeps the current
    setting). One thread is fastest for the particle envs on a 2-core machine: their tensors are
    small (tens of thousands of floats), so a second thread mostly adds synchronisation, and it
    collapses when other processes share the cores.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        rows = []
        for name in env_names:
            for n in num_envs:
                sps = bench_batched(name, n, seconds, device)
                rows.append({"env": name, "num_envs": n, "steps_per_second": sps, "device": device})
        if include_pettingzoo:
            sps = bench_pettingzoo_mpe(seconds)
            rows.append({"env": "mpe2", "num_envs": 1, "steps_per_second": sps, "device": "cpu"})
    finally:
        torch.set_num_threads(previous)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`run_env_bench` rows; with an ``mpe2`` row, each row's speed-up
    over it."""
    reference = next((r["steps_per_second"] for r in rows if r["env"] == "mpe2"), None)
    header = ["env", "num_envs", "device", "steps/s"] + (["x mpe2"] if reference else [])
    table = [header]
    for r in rows:
        line = [r["env"], str(r["num_envs"]), str(r["device"]), f"{r['steps_per_second']:,.0f}"]
        if reference:
            line.append(f"{r['steps_per_second'] / reference:,.1f}")
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
