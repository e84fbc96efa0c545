"""Google Research Football throughput: N worker processes against one game in one process.

Usage::

    python benchmarks/football_throughput.py [--scenario academy_3_vs_1_with_keeper]
        [--layouts 1x1 2x2 2x8 2x25] [--seconds 20] [--json]

Every row steps random joint actions with auto-reset and counts one step of one game as one env
step. The reference row (``1 game, in process``) steps a single
:class:`~mappo.envs.football.grf.FootballParallelEnv` in a plain loop, no adapter; a layout
``WxE`` is ``mappo.envs.make("football/<scenario>", num_envs=W*E, num_workers=W)``: W worker
processes of E games each, stepped in lock-step, observations copied to torch tensors. The ratio
column divides by the reference row of the same command.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def bench_reference(scenario: str, seconds: float) -> float:
    """Env steps/s of one game stepped in this process."""
    from mappo.envs.football import SCENARIOS
    from mappo.envs.football.grf import NUM_ACTIONS, FootballParallelEnv

    env = FootballParallelEnv(scenario, SCENARIOS[scenario][0])
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        env.step({a: int(rng.integers(NUM_ACTIONS)) for a in env.possible_agents})
        steps += 1
        if not env.agents:
            env.reset()
    rate = steps / (time.perf_counter() - start)
    env.close()
    return rate


def bench_adapter(scenario: str, workers: int, per_worker: int, seconds: float) -> float:
    """Env steps/s of ``workers`` processes of ``per_worker`` games each."""
    import torch

    from mappo.envs import make

    torch.set_num_threads(1)
    num_envs = workers * per_worker
    with make(f"football/{scenario}", num_envs=num_envs, num_workers=workers) as env:
        env.validate_actions = False
        ((name, group),) = env.spec.groups.items()
        gen = torch.Generator().manual_seed(0)
        shape = (num_envs, group.num_agents, 1)
        env.reset(seed=0)
        for _ in range(5):  # warm-up: first steps of fresh games
            env.step({name: torch.randint(0, group.action.nvec[0], shape, generator=gen)})
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            env.step({name: torch.randint(0, group.action.nvec[0], shape, generator=gen)})
            steps += num_envs
        return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="academy_3_vs_1_with_keeper")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x2", "2x8", "2x25"])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reference = bench_reference(args.scenario, args.seconds)
    rows = [("1 game, in process", reference)]
    for layout in args.layouts:
        workers, per_worker = (int(x) for x in layout.split("x"))
        rate = bench_adapter(args.scenario, workers, per_worker, args.seconds)
        rows.append((f"{workers} workers x {per_worker} games", rate))
    for label, rate in rows:
        if args.json:
            print(json.dumps({"scenario": args.scenario, "layout": label, "steps_per_s": rate}))
        else:
            print(f"{label:>24}  {rate:9.0f} env steps/s  {rate / reference:5.2f}x")


if __name__ == "__main__":
    main()
