"""The return of a scripted team on ``grid/spread``, to put learned returns in context.

The oracle sees the whole grid: at each episode start it assigns agents to targets by the
smallest total distance (all assignments tried) and every agent walks straight to its target
(rows first), then stays. A random team picks uniformly among the five moves.

    python benchmarks/grid_spread_oracle.py [--episodes 1000] [--seed 1] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from mappo.envs import make


def oracle_actions(env) -> torch.Tensor:  # noqa: ANN001 - a GridSpread
    """``[E, n, 1]``: each agent's step towards the target of the best assignment."""
    g, n = env.size, env.num_agents
    a_r, a_c = env.agents // g, env.agents % g
    t_r, t_c = env.targets // g, env.targets % g
    dist = (a_r.unsqueeze(2) - t_r.unsqueeze(1)).abs() + (a_c.unsqueeze(2) - t_c.unsqueeze(1)).abs()
    perms = torch.tensor(list(itertools.permutations(range(n))))  # [P, n]
    cost = dist[:, torch.arange(n), perms].sum(-1)  # [E, P]
    goal = perms[cost.argmin(1)]  # [E, n]: agent i's target
    g_r, g_c = t_r.gather(1, goal), t_c.gather(1, goal)
    # moves: 0 stay, 1 up, 2 down, 3 left, 4 right; rows first
    act = torch.zeros_like(a_r)
    act = torch.where(g_c > a_c, 4, act)
    act = torch.where(g_c < a_c, 3, act)
    act = torch.where(g_r > a_r, 2, act)
    act = torch.where(g_r < a_r, 1, act)
    return act.unsqueeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("kwargs", nargs="*", help="env parameters, e.g. size=9")
    args = parser.parse_args()
    kwargs = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.kwargs)}
    for name in ("oracle", "random"):
        env = make("grid/spread", num_envs=args.episodes, seed=args.seed, **kwargs)
        env.reset()
        total = torch.zeros(args.episodes)
        gen = torch.Generator().manual_seed(args.seed)
        for _ in range(env.length):
            if name == "oracle":
                act = oracle_actions(env)
            else:
                act = torch.randint(0, 5, (args.episodes, env.num_agents, 1), generator=gen)
            step = env.step({"agents": act})
            total += step.reward["agents"][:, 0]
        covered = float(step.stats["covered"].mean())
        print(
            f"{name}: mean return {float(total.mean()):.2f} (std {float(total.std()):.2f}) over "
            f"{args.episodes} episodes, targets covered at the end {covered:.3f}"
        )


if __name__ == "__main__":
    main()
