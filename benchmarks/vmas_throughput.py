"""Throughput of VMAS scenarios stepped directly and through :class:`mappo.envs.vmas.VmasEnv`.

VMAS (Bettini et al. 2022) simulates all envs as batched tensors; the wrapper adds the grouping
of per-agent tensors into ``[E, n, ...]``, the global state, rewards and flags, and the automatic
reset of finished envs. Sides, all with the same random continuous actions (uniform in the
action box, drawn before timing) and the same episode limit:

- **direct**: ``vmas.make_env(...).step(actions)`` with per-agent action tensors, nothing else.
  VMAS does not reset finished envs itself, so they go on simulating (a lower bound on cost);
- **direct+reset**: as direct, then what a loop of one's own has to do to start new episodes:
  ``reset_at(i)`` for each finished env and the observations recomputed once (``--no-resets``
  leaves it out);
- **wrapper**: ``VmasEnv.step({group: [E, n, d]})`` with ``validate_actions`` off, as in the
  trainer's hot loop: auto-reset (batched, see ``mappo.envs.vmas.env``) and ``final_obs``
  included.

Env steps/s = steps x envs / wall-clock seconds. The sides are measured in alternation,
``--rounds`` rounds of ``--steps`` steps each after ``--warmup`` steps, so that they see the same
load on a shared machine; the median rate of each side is reported (per wall-clock second and
per CPU second of the process), and the median over rounds of wrapper / direct (target: at least
0.9 at 4096 envs).

    python benchmarks/vmas_throughput.py [--scenario navigation balance] [--num-envs 4096]
        [--steps 300] [--rounds 10] [--warmup 10] [--device cpu] [--no-resets] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from mappo.envs.vmas import VmasEnv


def random_actions(env: VmasEnv, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of uniform actions inside each group's box, ``[E, n, d]`` float32."""
    gen = torch.Generator(device=env.device).manual_seed(seed)
    batches = []
    for _ in range(steps):
        batch = {}
        for name, group in env.spec.groups.items():
            low = torch.tensor(group.action.low, device=env.device)
            high = torch.tensor(group.action.high, device=env.device)
            shape = (env.num_envs, group.num_agents, len(group.action.low))
            u = torch.rand(shape, device=env.device, generator=gen)
            batch[name] = low + (high - low) * u
        batches.append(batch)
    return batches


def per_agent(env: VmasEnv, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The same actions as VMAS takes them: one ``[E, d]`` tensor per agent, in its order."""
    return [batch[group][:, k].contiguous() for group, k in env._slots]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], int], steps: int, num_envs: int, device: torch.device
) -> tuple[float, float]:
    """Env steps per wall-clock second and per CPU second of this process (all its threads:
    steadier than the wall clock where other processes share the cores)."""
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return steps * num_envs / wall, steps * num_envs / max(cpu, 1e-9)


def run(scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    e = args.num_envs
    wrapper = VmasEnv(scenario, num_envs=e, device=device, seed=0)
    wrapper.validate_actions = False
    import vmas

    def direct_env() -> Any:
        return vmas.make_env(
            scenario,
            num_envs=e,
            device=device,
            continuous_actions=True,
            terminated_truncated=True,
            max_steps=wrapper.max_steps,
            seed=0,
        )

    direct = direct_env()
    direct_reset = direct_env() if args.resets else None
    actions = random_actions(wrapper, args.warmup + args.steps, seed=1)
    lists = [per_agent(wrapper, batch) for batch in actions]
    finished = {"wrapper": 0, "direct+reset": 0}

    def step_direct(env: Any, resets: bool, batches: list[list[torch.Tensor]]) -> int:
        for batch in batches:
            _, _, terminated, truncated, _ = env.step(batch)
            if resets:
                done = (terminated | truncated).nonzero().flatten().tolist()
                if done:
                    if len(done) == e:
                        env.reset()
                    else:
                        for i in done:
                            env.reset_at(i, return_observations=False)
                        env.get_from_scenario(
                            get_observations=True,
                            get_rewards=False,
                            get_infos=False,
                            get_dones=False,
                        )
                    finished["direct+reset"] += len(done)
        return len(batches)

    def step_wrapper(batches: list[dict[str, torch.Tensor]]) -> int:
        for batch in batches:
            out = wrapper.step(batch)
            finished["wrapper"] += int(out.done.sum())
        return len(batches)

    wrapper.reset(seed=0)
    direct.reset(seed=0)
    if direct_reset is not None:
        direct_reset.reset(seed=0)
    w = args.warmup
    step_direct(direct, False, lists[:w])
    if direct_reset is not None:
        step_direct(direct_reset, True, lists[:w])
    step_wrapper(actions[:w])
    finished = dict.fromkeys(finished, 0)
    sides = ["direct"] + (["direct+reset"] if direct_reset is not None else []) + ["wrapper"]
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cpu_rates: dict[str, list[float]] = {side: [] for side in sides}
    chunk = max(1, args.steps // args.rounds)
    for r in range(args.rounds):
        part = slice(w + r * chunk, w + (r + 1) * chunk)
        runs = {
            "direct": lambda p=part: step_direct(direct, False, lists[p]),
            "direct+reset": lambda p=part: step_direct(direct_reset, True, lists[p]),
            "wrapper": lambda p=part: step_wrapper(actions[p]),
        }
        for side in sides:
            wall, cpu = timed(runs[side], chunk, e, device)
            rates[side].append(wall)
            cpu_rates[side].append(cpu)
    result: dict[str, Any] = {
        "scenario": scenario,
        "num_envs": e,
        "device": str(device),
        "steps_per_round": chunk,
        "rounds": args.rounds,
        "max_steps": wrapper.max_steps,
        "env_steps_per_s": {k: median(v) for k, v in rates.items()},
        "env_steps_per_cpu_s": {k: median(v) for k, v in cpu_rates.items()},
        "episodes_finished": finished,
    }
    for side in sides[:-1]:
        for key, table in (("wall", rates), ("cpu", cpu_rates)):
            pairs = zip(table["wrapper"], table[side], strict=True)
            result[f"wrapper_over_{side}_{key}"] = median(w / d for w, d in pairs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", nargs="+", default=["navigation", "balance"])
    parser.add_argument("--num-envs", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per side, in all")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-resets", dest="resets", action="store_false")
    parser.add_argument("--json", action="store_true", help="print one JSON line per scenario")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_grad_enabled(False)
    for scenario in args.scenario:
        result = run(scenario, args)
        result["machine"] = f"{platform.processor() or platform.machine()}, torch threads " + str(
            torch.get_num_threads()
        )
        if args.json:
            print(json.dumps(result))
            continue
        print(
            f"vmas/{scenario}, {result['num_envs']} envs on {result['device']} "
            f"({result['rounds']} x {result['steps_per_round']} steps per side, episode limit "
            f"{result['max_steps']}, {result['machine']})"
        )
        print(f"  {'':13s} {'env steps/s':>14s} {'per CPU s':>14s}")
        for side, rate in result["env_steps_per_s"].items():
            print(f"  {side:13s} {rate:14,.0f} {result['env_steps_per_cpu_s'][side]:14,.0f}")
        for side in result["env_steps_per_s"]:
            if side != "wrapper":
                wall = result[f"wrapper_over_{side}_wall"]
                cpu = result[f"wrapper_over_{side}_cpu"]
                print(f"  wrapper / {side + ':':14s} {wall:.3f} (CPU time: {cpu:.3f})")
        print(f"  episodes finished in the timed steps: {result['episodes_finished']}")


if __name__ == "__main__":
    main()
