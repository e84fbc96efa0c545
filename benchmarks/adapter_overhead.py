"""Overhead of the PettingZoo adapter, measured on mpe2's Spread (``simple_spread_v3``).

Both sides step the same ``workers x envs_per_worker`` envs with the same random actions:

- **direct**: a plain Python loop over the envs in this process (``env.step(dict)``, and
  ``env.reset()`` when an episode ends), which is what the adapter wraps;
- **adapter**: ``PettingZooAdapter`` with ``workers`` worker processes, actions given as one
  ``[E, 3]`` tensor per step and observations returned as tensors, as the trainer uses it
  (``validate_actions`` off, as in the trainer's hot loop).

Env steps/s = steps x envs / seconds (wall clock). The two are measured in alternation,
``--repeats`` pairs of ``--steps`` steps, so that both see the same load on a shared machine;
the median rate of each is reported, with the median over the pairs of adapter / direct (at
least 0.8 is the target at 8 workers x 16 envs on a 2-core CPU). ``--in-process`` also measures
the adapter with ``num_workers=0``: its own cost, without the parallelism of the workers.

Where ``/proc`` exists, the CPU time of each side (the adapter's: main process and workers
together) is reported too. On a machine that others keep busy, the wall-clock ratio mostly
measures how the scheduler shares the cores (Linux gives a whole session, workers included, one
fair share); the CPU-time ratio is the adapter's efficiency.

    python benchmarks/adapter_overhead.py [--workers 8] [--envs-per-worker 16] [--steps 50]
                                          [--repeats 5] [--in-process] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from statistics import median

import numpy as np
import torch

from mappo.envs.adapters import PettingZooAdapter

ENV = "mpe2.simple_spread_v3"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU time of processes ``pids`` (from ``/proc``; ``None`` without it)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def measure_direct(actions: np.ndarray, seed: int) -> tuple[float, float | None]:
    """Env steps/s and CPU seconds of a Python loop over ``E`` envs; ``actions``: ``[T, E, 3]``."""
    from mpe2 import simple_spread_v3

    steps, num_envs, _ = actions.shape
    envs = [simple_spread_v3.parallel_env() for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=seed + i)
    agents = envs[0].possible_agents
    cpu = cpu_seconds([os.getpid()])
    start = time.perf_counter()
    for t in range(steps):
        rows = actions[t].tolist()
        for env, row in zip(envs, rows, strict=True):
            env.step(dict(zip(agents, row, strict=True)))
            if not env.agents:
                env.reset()
    elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds([os.getpid()])
    for env in envs:
        env.close()
    used = None if cpu is None or cpu_after is None else cpu_after - cpu
    return steps * num_envs / elapsed, used


def measure_adapter(
    env: PettingZooAdapter, actions: np.ndarray, seed: int
) -> tuple[float, float | None]:
    """Env steps/s and CPU seconds (main process + workers) of the adapter."""
    steps = actions.shape[0]
    batch = torch.from_numpy(actions)
    env.reset(seed=seed)
    pids = [os.getpid(), *env.worker_pids]
    cpu = cpu_seconds(pids)
    start = time.perf_counter()
    for t in range(steps):
        env.step({"agent": batch[t]})
    elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds(pids)
    used = None if cpu is None or cpu_after is None else cpu_after - cpu
    return steps * env.num_envs / elapsed, used


def summary(runs: list[tuple[float, float | None]], direct: list[tuple[float, float | None]]):
    """Median rate, median paired ratio of rates, and CPU-time ratio (direct / this)."""
    rates = [r for r, _ in runs]
    ratio = median([r / d for (r, _), (d, _) in zip(runs, direct, strict=True)])
    cpus = [c for _, c in runs]
    direct_cpus = [c for _, c in direct]
    cpu_ratio = None
    if None not in cpus and None not in direct_cpus:
        cpu_ratio = sum(direct_cpus) / max(sum(cpus), 1e-9)
    return median(rates), ratio, cpu_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--envs-per-worker", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="pairs of measurements")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="also measure the adapter with num_workers=0 (its own cost, without parallelism)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    num_envs = args.workers * args.envs_per_worker
    rng = np.random.default_rng(args.seed)
    actions = rng.integers(0, 5, size=(args.steps, num_envs, 3), dtype=np.int64)

    start = time.perf_counter()
    env = PettingZooAdapter(ENV, num_envs=num_envs, seed=args.seed, num_workers=args.workers)
    startup_s = time.perf_counter() - start
    env.validate_actions = False
    local = None
    if args.in_process:
        local = PettingZooAdapter(ENV, num_envs=num_envs, seed=args.seed, num_workers=0)
        local.validate_actions = False
    # One short warm-up of each side (imports, first allocations) before measuring.
    measure_adapter(env, actions[:5], args.seed)
    measure_direct(actions[:5, : args.envs_per_worker], args.seed)

    direct, adapter, in_process = [], [], []
    try:
        for _ in range(args.repeats):
            direct.append(measure_direct(actions, args.seed))
            adapter.append(measure_adapter(env, actions, args.seed))
            if local is not None:
                in_process.append(measure_adapter(local, actions, args.seed))
    finally:
        env.close()
        if local is not None:
            local.close()

    direct_rate = median([r for r, _ in direct])
    adapter_rate, ratio, cpu_ratio = summary(adapter, direct)
    result = {
        "env": f"pettingzoo:{ENV}",
        "workers": args.workers,
        "envs_per_worker": args.envs_per_worker,
        "num_envs": num_envs,
        "steps": args.steps,
        "repeats": args.repeats,
        "direct_steps_per_s": direct_rate,
        "adapter_steps_per_s": adapter_rate,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "direct_all": [r for r, _ in direct],
        "adapter_all": [r for r, _ in adapter],
        "adapter_startup_s": startup_s,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    if in_process:
        rate, in_ratio, in_cpu_ratio = summary(in_process, direct)
        result |= {
            "in_process_steps_per_s": rate,
            "in_process_ratio": in_ratio,
            "in_process_cpu_ratio": in_cpu_ratio,
        }
    if args.json:
        print(json.dumps(result))
        return

    def cpu_note(value: float | None) -> str:
        return "" if value is None else f"; CPU-time ratio {value:.2f}"

    print(f"{result['env']}: {num_envs} envs, {args.repeats} x {args.steps} steps each (medians)")
    adapter_label = f"adapter ({args.workers} workers x {args.envs_per_worker})"
    print(f"  {'direct loop (1 process)':<30}{direct_rate:10,.0f} env steps/s")
    print(
        f"  {adapter_label:<30}{adapter_rate:10,.0f} env steps/s  "
        f"(workers started in {startup_s:.1f} s)"
    )
    print(f"  {'ratio adapter / direct':<30}{ratio:10.2f}{cpu_note(cpu_ratio)}")
    if in_process:
        print(
            f"  {'adapter in-process':<30}{result['in_process_steps_per_s']:10,.0f} env steps/s"
            f"  (ratio {result['in_process_ratio']:.2f}"
            f"{cpu_note(result['in_process_cpu_ratio'])}: the adapter's own cost)"
        )


if __name__ == "__main__":
    main()
